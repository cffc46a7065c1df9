"""What a compile-ahead job costs the train steps that run beside it on one CPU core.

Compile-ahead jobs start only while the trainer waits, but a job still compiling when the wait
ends goes on beside the next steps. This measures train steps of the long-tail benchmark's
model (``configs/bench_longtail.yaml``: hidden 128, 4 layers, unrolled) on an RL-length batch,
first alone, then right after a one-second wait that started compile-ahead jobs for three
sketched batches of long rows; for comparison, beside a pure-Python busy thread. Each side
runs in a fresh process pinned to one CPU (the trainer's share in the paper benchmarks), at
the default priority of the process (nice 0) and at the lowest (nice 19, the compile thread's
own since it was measured; setting 0 back needs root or CAP_SYS_NICE).

Usage: python benchmarks/compile_beside_step.py [--steps 8] [--cpu 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SIDES = ("compile-nice0", "compile-nice19", "python-busy-nice0", "python-busy-nice19")


def _nice(thread: threading.Thread, value: int) -> None:
    os.setpriority(os.PRIO_PROCESS, thread.native_id, value)


def measure(side: str, steps: int) -> dict:
    """Step seconds alone (median of 3) and then beside ``side``, in this process."""
    import jax  # noqa: F401 - after the CPU pinning of the parent's command

    from areal_jax.models import ModelConfig, export_hf, init_model
    from areal_jax.rl import MicroBatchConfig
    from areal_jax.trainer import Trainer, TrainerConfig
    from benchmarks.train_step import make_batch

    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": True})  # fmt: skip
    model_dir = tempfile.mkdtemp()
    export_hf(init_model(cfg, seed=0), model_dir)
    trainer = Trainer(TrainerConfig(model_path=model_dir, scan_layers=False, ppo_n_minibatches=2,
                                    micro_batch=MicroBatchConfig(token_budget=8192)))
    groups = make_batch(8, 1024, 512, "rl", seed=0)
    trainer.train_on_batch(groups)

    def timed_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            trainer.train_on_batch(groups)
            out.append(time.perf_counter() - start)
        return out

    alone = statistics.median(timed_steps(3))
    stop = threading.Event()
    if side.startswith("compile"):
        trainer.compile_ahead_for([[1000] * 8, [700] * 8, [400] * 16])
        with trainer.idle():
            time.sleep(1.3)  # a wait long enough to start the first job
        for thread in threading.enumerate():
            if thread.name == "compile-ahead":  # nice 19 by default: set as the side says
                _nice(thread, 19 if side.endswith("nice19") else 0)
    else:
        def busy():
            while not stop.is_set():
                sum(range(1000))
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        _nice(thread, 19 if side.endswith("nice19") else 0)
    beside = timed_steps(steps)
    stop.set()
    trainer.close()  # waits for a compile still running: the process must not exit under it
    return {"side": side, "alone_s": alone, "beside_s": beside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps timed beside each side")
    parser.add_argument("--cpu", type=int, default=0, help="the one CPU every side runs on")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in-process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.steps)), flush=True)
        return
    print(f"one CPU ({args.cpu}) of {os.cpu_count()}; steps of an RL-length batch, seconds\n")
    print("| beside | alone (median) | each step beside it |")
    print("|---|---:|---|")
    for side in SIDES:
        out = subprocess.run(
            ["taskset", "-c", str(args.cpu), sys.executable, __file__, "--side", side,
             "--steps", str(args.steps)],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": "."})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        steps = ", ".join(f"{s:.1f}" for s in r["beside_s"])
        print(f"| {side} | {r['alone_s']:.2f} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
