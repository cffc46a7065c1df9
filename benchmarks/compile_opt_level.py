"""Compile time and step time of the trainer's programs against XLA's CPU optimisation level.

``trainer.cpu_opt_level`` sets XLA's backend (LLVM) optimisation level of the train programs on
a CPU backend. This measures, for each level, a trainer of the long-tail benchmark's model
(``configs/bench_longtail.yaml``: hidden 128, 4 unrolled layers) on one CPU core: the seconds
its first step compiles (the step's shapes and the update), then the median seconds of the
steps after it, for a batch of 64 equal trajectories of 60 tokens and for a long-tailed batch
(rows of up to 1024 tokens). Each (level, repetition) runs in a fresh process pinned to one
core, with the persistent compilation cache off; levels are interleaved within a repetition.

Usage: PYTHONPATH=. python benchmarks/compile_opt_level.py [--levels default 1 0] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHORT = [60] * 64
# Long-tailed token counts (prompt + response) of one batch of 64: rows of 128 to 1024.
LONG_TAIL = ([40] * 19 + [60] * 16 + [80] * 10 + [120] * 8 + [200] * 6 + [400] * 3 + [700] * 2)


def _child(level: str, steps: int) -> dict:
    """One trainer at ``level``: compile seconds of each batch's first step, median step s."""
    import jax
    import numpy as np

    jax.config.update("jax_compilation_cache_dir", "")
    from areal_jax.compilation import CompileMeter
    from areal_jax.models import ModelConfig, init_model
    from areal_jax.parallel import MeshConfig, make_mesh
    from areal_jax.rl import MicroBatchConfig
    from areal_jax.trainer import Trainer, TrainerConfig
    from areal_jax.trajectory import Trajectory, TrajectoryGroup

    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": True})  # fmt: skip
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    trainer = Trainer(
        TrainerConfig(lr=5e-5, scan_layers=False, ppo_n_minibatches=2, compile_ahead=False,
                      micro_batch=MicroBatchConfig(token_budget=8192),
                      cpu_opt_level=None if level == "default" else int(level)),
        mesh=mesh, model=init_model(cfg, seed=0, scan_layers=False))
    rng = np.random.default_rng(0)

    def batch(lengths: list[int]) -> list[TrajectoryGroup]:
        groups = []
        for g in range(0, len(lengths), 8):
            trajs = [Trajectory(list(range(1, 21)), rng.integers(1, 500, n - 20).tolist(),
                                np.full(n - 20, -1.0), np.zeros(n - 20, int),
                                reward=float(rng.integers(2))) for n in lengths[g:g + 8]]
            groups.append(TrajectoryGroup(f"p{g}", trajs))
        return groups

    meter, out = CompileMeter(), {}
    for name, lengths in (("equal", SHORT), ("long_tail", LONG_TAIL)):
        meter.take()
        trainer.train_on_batch(batch(lengths))
        out[f"{name}_compile_s"] = meter.take()[0]
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_on_batch(batch(lengths))
            times.append(time.perf_counter() - start)
        out[f"{name}_step_s"] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["default", "1", "0"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per batch kind")
    parser.add_argument("--cpu", type=int, default=0, help="the core every process runs on")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        os.sched_setaffinity(0, {args.cpu})
        print(json.dumps(_child(args.child, args.steps)))
        return
    results: dict[str, list[dict]] = {level: [] for level in args.levels}
    for rep in range(args.reps):
        for level in args.levels:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", level, "--steps", str(args.steps),
                 "--cpu", str(args.cpu)], capture_output=True, text=True, check=True)
            results[level].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"rep {rep} level {level}: {results[level][-1]}", flush=True)
    keys = ["equal_compile_s", "equal_step_s", "long_tail_compile_s", "long_tail_step_s"]
    print("\n| level | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    for level, runs in results.items():
        cells = []
        for key in keys:
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        print(f"| {level} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
