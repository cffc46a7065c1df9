"""The paper's claims against our measurements: one table from the paper benchmarks' JSON.

Reads the ``summary`` rows of every ``benchmarks/results/paper/*.json``, and of the
accelerator recordings beside them (``<name>_gpu/<name>.json``, each after its CPU row), and
writes
``benchmarks/results/paper/SUMMARY.md``: figure, the paper's number, our goal, the measured
ratio (median [min-max] over seeds or repetitions), machine and load, and the exact command.

Usage: PYTHONPATH=. python benchmarks/paper/summary.py
"""

from __future__ import annotations

import argparse
import json

from benchmarks.paper import common

ORDER = ("async_vs_sync", "staleness_ablation", "interrupt_vs_drain", "microbatch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_out_argument(parser)
    out = parser.parse_args().out
    found = {p.stem: [p] for p in out.glob("*.json")}
    for p in out.glob("*_gpu/*.json"):
        found.setdefault(p.stem, []).append(p)
    if not found:
        raise SystemExit(f"no results in {out}: run the benchmarks first")
    rows = []
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        for path in sorted(found[name], key=lambda p: p.parent != out):
            details = path.relative_to(out).with_suffix(".md").as_posix()
            for row in json.loads(path.read_text()).get("summary", []):
                rows.append([row["figure"], row["paper"], row["goal"], row["measured"],
                             row["machine"], row["load"], f"`{row['command']}`",
                             f"[{details}]({details})"])
    text = ("# The paper's claims, reproduced\n\nMeasured: median [min-max] over seeds or "
            "repetitions; load: 1-minute load average before -> after.\n\n"
            + common.table(["figure", "paper", "goal", "measured", "machine", "load",
                            "command", "details"], rows) + "\n")
    (out / "SUMMARY.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
