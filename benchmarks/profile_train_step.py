"""Where a train step's time goes: a ``jax.profiler`` trace of ``benchmarks/train_step.py``'s
step, summed per kind of XLA operation.

Builds the same model and batch as ``train_step.py`` (``--lengths``, ``--scan-layers``), runs
two warm-up steps, traces ``--steps`` steps and prints the milliseconds per step of each kind
of compiled operation (the fusion's name without its number: ``ynn_fusion`` are XLA's matrix
product kernels, ``copy_*`` layout copies, ``*_fusion`` element-wise work). Host-side and
runtime events are left out. Kinds overlap where XLA runs operations on two threads at once, so
the column can sum to more than the step.

Usage: PYTHONPATH=. python benchmarks/profile_train_step.py [--lengths fixed --scan-layers false]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax

from areal_jax.models import ModelConfig, export_hf, init_model
from benchmarks.train_step import MODEL, make_batch, ours_step

_NOT_OPS = re.compile(r"^\$|Execute|Pjit|ThreadPool|np\.asarray")


def kinds_by_thread(trace_dir: str) -> dict[str, collections.Counter]:
    """Microseconds per kind of compiled operation in the trace under ``trace_dir``, for each
    "process / thread" of the trace (on a GPU, its streams are threads of the device's process)."""
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    names = {(e["pid"], e.get("tid") if e["name"] == "thread_name" else None): e["args"]["name"]
             for e in events if e.get("ph") == "M" and e.get("name") in ("process_name",
                                                                      "thread_name")}
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and not _NOT_OPS.search(e["name"]):
            process = names.get((e["pid"], None), e["pid"])
            where = f"{process} / {names.get((e['pid'], e.get('tid')), e.get('tid'))}"
            threads[where][re.sub(r"[.\d]+$", "", e["name"])] += e["dur"]
    return dict(threads)


def op_kinds(trace_dir: str) -> collections.Counter:
    """Microseconds per kind of compiled operation in the trace under ``trace_dir``."""
    return sum(kinds_by_thread(trace_dir).values(), collections.Counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["fixed", "rl"], default="fixed")
    parser.add_argument("--scan-layers", choices=["true", "false"], default="false")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf_dict(MODEL)
    groups = make_batch(args.rows, args.seq, cfg.vocab_size, args.lengths)
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as trace:
        export_hf(init_model(cfg, seed=0), model_dir)
        step = ours_step(model_dir, groups, args.rows, args.seq, decoupled=False,
                         scan_layers=args.scan_layers == "true", dtype="float32")
        step()
        start = time.perf_counter()
        step()
        untraced = time.perf_counter() - start
        with jax.profiler.trace(trace):
            for _ in range(args.steps):
                step()
        kinds = op_kinds(trace)
    print(f"step (untraced): {untraced * 1e3:.0f} ms; {args.lengths} lengths, "
          f"scan_layers {args.scan_layers}; ms per step by kind of operation:")
    for name, us in kinds.most_common(args.top):
        print(f"{us / args.steps / 1e3:9.1f}  {name}")


if __name__ == "__main__":
    main()
