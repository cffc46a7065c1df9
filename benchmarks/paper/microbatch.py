"""Dynamic micro-batching against a fixed count of padded micro-batches, same token budget.

The whole ``Trainer.train_on_batch`` (decoupled PPO, proximal forward included, one
minibatch) on batches with RL-shaped lengths (a 64-token prompt, responses log-uniform from 16
to ``--seq`` - 64 tokens; the model of benchmarks/train_step.py), with
``micro_batch.mode=dynamic`` (Algorithm 1: sequences packed under ``--token-budget``) and
``mode=fixed``: the batch cut into a fixed count of micro-batches, one sequence per row, padded
to the longest. The fixed count is the smallest that is safe for any order of the batch
(ceil(sequences / (budget // longest))), as a fixed setting must be: a larger micro-batch could
exceed the memory the budget stands for. Each measurement runs in a fresh process, modes
alternate, and each repetition draws a new batch; the ratio is taken per repetition. Paper: +30%.

Usage: PYTHONPATH=. python benchmarks/paper/microbatch.py [--repeats 5 --steps 5]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.paper import common

MODES = ("dynamic", "fixed")


def batch(args, rep: int):
    from areal_jax.models import ModelConfig
    from benchmarks.train_step import MODEL, make_batch

    return make_batch(args.rows, args.seq, ModelConfig.from_hf_dict(MODEL).vocab_size, "rl",
                      seed=rep)


def safe_fixed_count(lengths: list[int], budget: int) -> int:
    """Fewest micro-batches whose padded size fits ``budget`` whatever the sequence order."""
    per_batch = budget // max(lengths)
    if per_batch < 1:
        raise SystemExit(f"--token-budget {budget} is below the longest sequence {max(lengths)}")
    return math.ceil(len(lengths) / per_batch)


def measure(mode: str, count: int, rep: int, args) -> dict:
    """Seconds per ``train_on_batch`` after warm-up, and the packed shapes, in this process."""
    from areal_jax.models import ModelConfig, export_hf, init_model
    from areal_jax.rl import MicroBatchConfig, pack_micro_batches
    from areal_jax.trainer import Trainer, TrainerConfig
    from benchmarks.train_step import MODEL

    groups = batch(args, rep)
    mb = MicroBatchConfig(token_budget=args.token_budget, mode=mode, num_micro_batches=count)
    with tempfile.TemporaryDirectory() as model_dir:
        export_hf(init_model(ModelConfig.from_hf_dict(MODEL), seed=0), model_dir)
        trainer = Trainer(TrainerConfig(model_path=model_dir, lr=1e-5, ppo_n_minibatches=1,
                                        micro_batch=mb, scan_layers=False))
        for _ in range(args.warmup):
            trainer.train_on_batch(groups)
        seconds = []
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.train_on_batch(groups)
            seconds.append(time.perf_counter() - start)
    trajs = [t for g in groups for t in g.trajectories]
    packed = pack_micro_batches(trajs, [0.0] * len(trajs), mb)
    return {"seconds": seconds, "micro_batches": len(packed),
            "padded_tokens": sum(b.shape[0] * b.shape[1] for b in packed),
            "tokens": sum(t.length for t in trajs)}


def in_fresh_process(*job) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, *job).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16,
                        help="a batch holds about 0.9 x rows x seq tokens")
    parser.add_argument("--seq", type=int, default=1024, help="longest sequence (prompt 64)")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--repeats", type=int, default=5, help="batches, each measured per mode")
    common.add_out_argument(parser)
    args = parser.parse_args()

    before = common.machine()
    samples: list[dict] = []
    for rep in range(args.repeats):
        lengths = [t.length for g in batch(args, rep) for t in g.trajectories]
        count = safe_fixed_count(lengths, args.token_budget)
        row = {"rep": rep, "sequences": len(lengths), "fixed_count": count}
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            row[mode] = in_fresh_process(mode, count, rep, args)
            print(f"batch {rep}, {mode}: {statistics.median(row[mode]['seconds']):.3f} s/step, "
                  f"{row[mode]['micro_batches']} micro-batches", flush=True)
        samples.append(row)

    def per_mode(key):
        return {m: common.spread([key(r[m]) for r in samples]) for m in MODES}

    step_s = per_mode(lambda m: statistics.median(m["seconds"]))
    tokens_s = per_mode(lambda m: m["tokens"] / statistics.median(m["seconds"]))
    padding = per_mode(lambda m: 1 - m["tokens"] / m["padded_tokens"])
    count = per_mode(lambda m: m["micro_batches"])
    ratio = common.spread([statistics.median(r["fixed"]["seconds"])
                           / statistics.median(r["dynamic"]["seconds"]) for r in samples])
    rows = [[m, common.fmt_spread(step_s[m], 3), common.fmt_spread(tokens_s[m], 0),
             common.fmt_spread(count[m], 0), common.fmt_spread(padding[m])] for m in MODES]
    info = common.with_load_after(before)
    common.bar_plot(args.out / "microbatch.png", "Train-step throughput",
                    "tokens/s (median, min-max)", tokens_s)
    gain = f"+{(ratio['median'] - 1) * 100:.0f}%"
    sections = [
        f"## Train step, token budget {args.token_budget} ({args.repeats} batches of about "
        f"{statistics.mean(r['sequences'] for r in samples):.0f} sequences up to {args.seq} "
        f"tokens; {args.steps} timed steps each; median [min-max] over batches)\n\n"
        + common.table(["mode", "s/step", "tokens/s", "micro-batches", "padding share"], rows),
        f"Dynamic is {common.fmt_spread(ratio)}x the fixed mode's throughput ({gain}; paper "
        f"+30%, goal >= +30%: {'met' if ratio['median'] >= 1.3 else 'NOT met'}).",
        "![throughput](microbatch.png)",
    ]
    payload = {"machine": info, "args": common.arguments(args), "samples": samples,
               "stats": {"step_s": step_s, "tokens_s": tokens_s, "ratio": ratio},
               "summary": [common.summary_row(
                   "dynamic micro-batching vs fixed count (paper Sec. 5 / Fig. 6)",
                   "+30% training throughput", ">= +30%",
                   f"{common.fmt_spread(ratio)}x ({gain})", info)]}
    common.write_report(args.out, "microbatch", "Dynamic vs fixed micro-batches", sections,
                        payload)


if __name__ == "__main__":
    main()
