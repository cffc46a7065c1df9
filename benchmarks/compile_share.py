"""Compilation's share of the RL phase of finished runs, from their own metrics.

For each run directory: the RL phase's wall time (``results.json``), the seconds the loop spent
compiling where programs were needed (``timing/compile_s``, on the critical path) and their
share of the phase (loading programs from the persistent cache included), the versions after
version 3 that compiled a program there (``compile/programs``; runs recorded before the
metric ``compile/loaded`` existed counted loads from the cache as compiles), the versions after
version 3 whose step waited ``WAIT_S`` or more for programs however it got them (a load from
the cache, or the compile helper's job still running: no program compiled there, yet time on
the critical path), the programs loaded from the cache in the loop, and the seconds compiled
ahead in the background (``timing/compile_ahead_s``, off the critical path).

Usage: python benchmarks/compile_share.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


WAIT_S = 1.0  # a step's wait for programs counted as slow from here on


def compile_share(run_dir: Path) -> dict:
    """The figures above for one run directory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/compile_s" in r]
    wall = json.loads((run_dir / "results.json").read_text())["wall_s"]
    compile_s = sum(r["timing/compile_s"] for r in steps)
    evals = [r for r in rows if r["step"] == 0 and "eval/accuracy" in r]
    loop_s = steps[-1]["wall_time"] - evals[0]["wall_time"] if steps and evals else float("nan")
    late = [int(r["step"]) for r in steps if r["step"] > 3 and r["compile/programs"] > 0]
    waits = [(int(r["step"]), r["timing/compile_s"]) for r in steps
             if r["step"] > 3 and r["timing/compile_s"] >= WAIT_S]
    return {"run": str(run_dir), "versions": len(steps), "rl_wall_s": wall,
            "compile_s": compile_s, "share": compile_s / wall, "loop_s": loop_s,
            "first_version_compile_s": steps[0]["timing/compile_s"] if steps else 0.0,
            "versions_compiling_after_3": late,
            "waits_after_3": waits,
            "loaded": int(sum(r.get("compile/loaded", 0) for r in steps)),
            "compile_ahead_s": sum(r.get("timing/compile_ahead_s", 0.0) for r in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | versions | RL phase (s) | compile in the loop (s) | share | loop (s) "
          "| of it version 1 (s) | versions compiling after 3 | waits after 3 (version: s) "
          "| loaded from the cache | compiled ahead (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for run in args.runs:
        if not (run / "results.json").is_file():
            print(f"| {run.name} | not finished (no results.json): no RL phase to share |")
            continue
        c = compile_share(run)
        print(f"| {run.name} | {c['versions']} | {c['rl_wall_s']:.1f} | {c['compile_s']:.1f} "
              f"| {c['share']:.1%} | {c['loop_s']:.1f} | {c['first_version_compile_s']:.1f} "
              f"| {c['versions_compiling_after_3'] or '-'} "
              f"| {', '.join(f'{v}: {t:.1f}' for v, t in c['waits_after_3']) or '-'} "
              f"| {c['loaded']} "
              f"| {c['compile_ahead_s']:.1f} |")


if __name__ == "__main__":
    main()
