"""JAX generation engine throughput on this machine; records numbers, asserts nothing.

1. Decode throughput: the JAX engine against transformers ``generate`` on the same model, the
   same prompts, batch size and token budget, greedy and sampled, timed round-robin. Each side
   is warmed up first; the engine's compile time (first run minus a warm run) is reported on
   its own. transformers runs with one torch thread and with its default; the faster counts.
2. Weight swaps under load: closed-loop clients keep a stream of requests going (prompts of 16
   to 128 tokens, outputs long-tailed as in RL: log-uniform from 16 to 768 tokens) while a new
   checkpoint arrives every ``--update-every`` seconds; tokens/s with interruptible swaps
   (re-prefill and continue) against wait-for-drain swaps, in alternating segments.

The model (random weights, no end-of-sequence id so every request runs to its token budget):
qwen2 architecture, hidden 256, 4 layers, 8 heads / 4 KV heads, MLP 768, vocabulary 2048,
untied head (4.2M parameters).

Usage: PYTHONPATH=. python benchmarks/engine.py [--reps 5 --duration 60 --update-every 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import ModelConfig, export_hf, init_model
from rollout.config import EngineConfig
from rollout.engine import SamplingParams
from rollout.engines import create_engine

MODEL = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 1024, "tie_word_embeddings": False,
         "eos_token_id": None}  # fmt: skip
RESULTS = Path(__file__).parent / "results" / "engine.md"
MAX_PROMPT = 128  # prompts of the swap benchmark: 16 to 128 tokens


def write_models(root: Path) -> list[str]:
    """Two random checkpoints of the benchmark model (the swap benchmark alternates them)."""
    cfg = ModelConfig.from_hf_dict(MODEL)
    models = [init_model(cfg, seed=s, dtype=jnp.float32) for s in (0, 1)]
    return [str(export_hf(m, root / f"m{i}")) for i, m in enumerate(models)]


async def engine_for(path: str, **options):
    engine = create_engine(EngineConfig(kind="jax", model_path=path, options=options))
    await engine.start()
    return engine


# 1. Decode throughput -----------------------------------------------------------------------


SAMPLING = {"greedy": {}, "T=1": {"temperature": 1.0},
            "T=1, top-p 0.9": {"temperature": 1.0, "top_p": 0.9}}  # fmt: skip


def sampling(kind: str, n: int) -> SamplingParams:
    return SamplingParams(n, **{"temperature": 0.0, **SAMPLING[kind]})


async def jax_batch(engine, prompts, kind: str, n: int) -> float:
    """Seconds to generate ``n`` tokens for every prompt at once."""
    start = time.perf_counter()
    results = await asyncio.gather(*[
        engine.generate_full(p, sampling(kind, n), f"b{i}") for i, p in enumerate(prompts)])
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == n for r in results)
    return elapsed


def hf_batch(model, prompts, kind: str, n: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    kw = dict(do_sample=False)
    if kind != "greedy":  # top_k=0 turns off transformers' default top-k of 50
        kw = {"do_sample": True, "top_k": 0, "top_p": 1.0, **SAMPLING[kind]}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, **kw)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + n
    return elapsed


async def decode_benchmark(path, args) -> tuple[list[dict], list[dict]]:
    """Throughput rows and compile-time rows. Sides are timed round-robin (median of
    ``--reps`` rounds), so load from other processes hits every side alike."""
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    prompts = rng.integers(1, MODEL["vocab_size"], (args.batch, args.prompt_len)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    thread_counts = sorted({1, torch.get_num_threads()})  # one thread is often faster here
    engines, compile_rows = {}, []
    for steps in args.steps_per_call:
        engines[steps] = await engine_for(path, num_slots=args.batch,
                                          max_seq_len=args.prompt_len * 4,
                                          decode_steps_per_call=steps)
        first = await jax_batch(engines[steps], prompts, "greedy", args.new_tokens)
        warm = await jax_batch(engines[steps], prompts, "greedy", args.new_tokens)
        compile_rows.append({"steps/call": steps, "first run s": first, "warm run s": warm,
                             "compile s (difference)": first - warm})
        print(f"JAX engine, {steps} steps/call: first run {first:.1f} s, warm {warm:.2f} s",
              flush=True)
    for kind in SAMPLING:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            hf_batch(hf, prompts, kind, 8)  # warm-up
        for steps, engine in engines.items():
            await jax_batch(engine, prompts, kind, 8)  # warm-up
    times: dict[tuple, list[float]] = {}
    for rep in range(args.reps):
        for kind in SAMPLING:
            for threads in thread_counts:
                torch.set_num_threads(threads)
                t = hf_batch(hf, prompts, kind, args.new_tokens)
                name = f"transformers generate, {threads} torch thread(s)"
                times.setdefault((name, kind), []).append(t)
            for steps, engine in engines.items():
                t = await jax_batch(engine, prompts, kind, args.new_tokens)
                times.setdefault((f"JAX engine, {steps} steps/call", kind), []).append(t)
        print(f"round {rep + 1}/{args.reps} done", flush=True)
    for engine in engines.values():
        await engine.shutdown()
    tokens = args.batch * args.new_tokens
    rows = [{"engine": name, "sampling": kind, "tokens/s": tokens / statistics.median(ts)}
            for (name, kind), ts in times.items()]
    return rows, compile_rows


# 2. Weight swaps under load -----------------------------------------------------------------


async def swap_segment(paths, mode: str, seconds: float, seed: int, warm: bool, args) -> dict:
    """One timed stretch of load with updates in ``mode``: tokens, seconds, update call times.

    ``warm`` first compiles every prefill bucket and decode window (compiled programs are
    shared by later engines in the process)."""
    seq_len = 1 << (MAX_PROMPT + args.max_new - 1).bit_length()
    engine = await engine_for(paths[0], num_slots=args.batch, max_seq_len=seq_len,
                              decode_steps_per_call=8, swap_mode=mode)
    if warm:
        for bucket in engine.options.prefill_buckets:
            await engine.generate_full([1] * (bucket - 1), SamplingParams(1), "warm")
        await engine.generate_full([1] * 10, SamplingParams(seq_len - 10), "warm")
    rng = random.Random(seed)
    stop = time.perf_counter() + seconds
    counted = 0
    latencies: list[float] = []

    async def client(i: int) -> None:
        nonlocal counted
        while time.perf_counter() < stop:
            length = rng.randint(16, MAX_PROMPT)
            prompt = [rng.randrange(1, MODEL["vocab_size"]) for _ in range(length)]
            n = int(math.exp(rng.uniform(math.log(args.min_new), math.log(args.max_new))))
            params = SamplingParams(n, temperature=1.0, seed=rng.randrange(2**31))
            async with contextlib.aclosing(engine.generate(prompt, params, f"c{i}")) as chunks:
                async for chunk in chunks:
                    if time.perf_counter() >= stop:
                        return
                    counted += len(chunk.token_ids)

    async def updater() -> None:
        version, start = 0, time.perf_counter()
        while True:
            due = start + (version + 1) * args.update_every
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if time.perf_counter() >= stop:
                return
            t = time.perf_counter()
            version += 1
            await engine.update_weights(paths[version % 2], version)
            latencies.append(time.perf_counter() - t)

    began = time.perf_counter()
    await asyncio.gather(updater(), *[client(i) for i in range(args.clients)])
    elapsed = time.perf_counter() - began
    reprefills = engine.stats()["reprefills"]
    await engine.shutdown()
    return {"tokens": counted, "seconds": elapsed, "latencies": latencies,
            "reprefills": reprefills}


def swap_benchmark(paths, args) -> list[dict]:
    """Both modes in alternating segments (same request streams), so load from other
    processes hits both alike; one row per mode, over all its segments."""
    runs: dict[str, list[dict]] = {"interrupt": [], "drain": []}
    for segment in range(args.segments):
        for mode in runs:
            warm = not any(runs.values())
            run = asyncio.run(
                swap_segment(paths, mode, args.duration / args.segments, segment, warm, args))
            runs[mode].append(run)
            print(f"{mode} segment {segment + 1}/{args.segments}: "
                  f"{run['tokens'] / run['seconds']:.0f} tokens/s", flush=True)
    rows = []
    for mode, segs in runs.items():
        latencies = [x for r in segs for x in r["latencies"]]
        rows.append({"swap mode": mode,
                     "tokens/s": sum(r["tokens"] for r in segs) / sum(r["seconds"] for r in segs),
                     "swaps": len(latencies),
                     "mean update call s": statistics.mean(latencies) if latencies else 0.0,
                     "max update call s": max(latencies, default=0.0),
                     "re-prefills": sum(r["reprefills"] for r in segs)})
    return rows


# Report -------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def decode_goal(rows: list[dict]) -> list[str]:
    """Goal: the JAX engine at >= 3x transformers, per sampling kind, met or not."""
    lines = []
    for kind in SAMPLING:
        best = lambda prefix: max(r["tokens/s"] for r in rows  # noqa: E731
                                  if r["sampling"] == kind and r["engine"].startswith(prefix))
        ratio = best("JAX") / best("transformers")
        lines.append(f"- {kind}: JAX engine {ratio:.2f}x the faster transformers setting "
                     f"(goal >= 3x: {'met' if ratio >= 3 else 'NOT met'})")
    return lines


def swap_goal(rows: list[dict]) -> list[str]:
    """Goal: interruptible swaps give more tokens/s than waiting for a drain."""
    by_mode = {r["swap mode"]: r["tokens/s"] for r in rows}
    ratio = by_mode["interrupt"] / by_mode["drain"]
    return [f"- weight swaps under load: interrupt {ratio:.2f}x drain "
            f"(goal > 1x: {'met' if ratio > 1 else 'NOT met'})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="requests at once = engine slots")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per swap mode")
    parser.add_argument("--segments", type=int, default=3, help="alternating stretches per mode")
    parser.add_argument("--update-every", type=float, default=2.0, help="seconds between updates")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop request streams")
    parser.add_argument("--min-new", type=int, default=16, help="swap benchmark output lengths: "
                        "log-uniform from --min-new to --max-new (long-tailed, as in RL)")
    parser.add_argument("--max-new", type=int, default=768)
    parser.add_argument("--parts", nargs="+", choices=["decode", "swap"],
                        default=["decode", "swap"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    sections, summary = [], []
    with tempfile.TemporaryDirectory() as root:
        paths = write_models(Path(root))
        if "decode" in args.parts:
            decode_rows, compile_rows = asyncio.run(decode_benchmark(paths[0], args))
            sections.append(
                f"## Decode throughput ({args.batch} requests, prompt {args.prompt_len}, "
                f"{args.new_tokens} new tokens each, median of {args.reps} round-robin rounds)"
                f"\n\n{table(decode_rows)}\n\nCompile time (first run minus a warm run, "
                f"greedy):\n\n{table(compile_rows)}")
            summary += decode_goal(decode_rows)
        if "swap" in args.parts:
            swap_rows = swap_benchmark(paths, args)
            sections.append(
                f"## Weight swaps under load ({args.clients} clients, prompts 16-{MAX_PROMPT}, "
                f"outputs log-uniform {args.min_new}-{args.max_new} tokens, an update every "
                f"{args.update_every:g} s, {args.duration:g} s per mode in {args.segments} "
                f"alternating segments)\n\n{table(swap_rows)}")
            summary += swap_goal(swap_rows)
    sections.append("## Goals\n\n" + "\n".join(summary))
    print(*sections, sep="\n\n")
    command = " ".join(["PYTHONPATH=. python benchmarks/engine.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# JAX engine benchmark\n\nCommand: `{command}`\n\n"
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, {jax.device_count()} JAX "
        f"device(s) ({jax.default_backend()}), JAX {jax.__version__}.\n\n"
        + "\n\n".join(sections) + "\n"
    )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
