"""JAX generation engine throughput on this machine; records numbers, asserts nothing.

1. Decode throughput: the JAX engine against transformers ``generate`` on the same model, the
   same prompts, batch size and token budget, greedy and sampled. Each side is warmed up first;
   the engine's compile time (first run minus a warm run) is reported on its own.
2. Weight swaps under load: closed-loop clients keep a stream of requests of varied prompt and
   output lengths going while a new checkpoint arrives every ``--update-every`` seconds; tokens/s
   with interruptible swaps (re-prefill and continue) against wait-for-drain swaps.

The model (random weights, no end-of-sequence id so every request runs to its token budget):
qwen2 architecture, hidden 256, 4 layers, 8 heads / 4 KV heads, MLP 768, vocabulary 2048,
untied head (about 6.3M parameters).

Usage: PYTHONPATH=. python benchmarks/engine.py [--duration 30 --update-every 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


def write_models(root: Path) -> list[str]:
    """Two random checkpoints of the benchmark model (the swap benchmark alternates them)."""
    cfg = ModelConfig.from_hf_dict(MODEL)
    return [str(export_hf(init_model(cfg, seed=s, dtype=jnp.float32), root / f"m{s}")) for s in (0, 1)]


async def engine_for(path: str, **options):
    engine = create_engine(EngineConfig(kind="jax", model_path=path, options=options))
    await engine.start()
    return engine


# 1. Decode throughput -----------------------------------------------------------------------


def sampling(kind: str, n: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(n, temperature=0.0)
    return SamplingParams(n, temperature=1.0, top_p=0.9)


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
    kw = dict(do_sample=False) if kind == "greedy" else dict(do_sample=True, top_p=0.9, top_k=0,
                                                             temperature=1.0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, **kw)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + n
    return elapsed


async def decode_benchmark(path, args) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    prompts = rng.integers(1, MODEL["vocab_size"], (args.batch, args.prompt_len)).tolist()
    tokens = args.batch * args.new_tokens
    rows = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for kind in ("greedy", "sampled"):
        hf_batch(hf, prompts, kind, 8)  # warm-up
        t = statistics.median(hf_batch(hf, prompts, kind, args.new_tokens) for _ in range(args.reps))
        rows.append({"engine": "transformers generate", "sampling": kind, "tokens/s": tokens / t,
                     "compile s": None})
        print(f"transformers {kind}: {tokens / t:.0f} tokens/s", flush=True)
    for steps in args.steps_per_call:
        engine = await engine_for(path, num_slots=args.batch, max_seq_len=args.prompt_len * 4,
                                  decode_steps_per_call=steps)
        for kind in ("greedy", "sampled"):
            first = await jax_batch(engine, prompts, kind, args.new_tokens)
            t = statistics.median([await jax_batch(engine, prompts, kind, args.new_tokens)
                                   for _ in range(args.reps)])
            rows.append({"engine": f"JAX engine, {steps} steps/call", "sampling": kind,
                         "tokens/s": tokens / t, "compile s": first - t})
            print(f"JAX engine {steps} steps/call {kind}: {tokens / t:.0f} tokens/s "
                  f"(first run {first:.1f} s)", flush=True)
        await engine.shutdown()
    return rows


# 2. Weight swaps under load -----------------------------------------------------------------


async def swap_benchmark(paths, mode: str, args) -> dict:
    engine = await engine_for(paths[0], num_slots=args.batch, max_seq_len=512,
                              decode_steps_per_call=8, swap_mode=mode)
    for n in (10, 20, 40, 100, 200, 400):  # compile every prefill bucket before timing
        await engine.generate_full(list(range(1, n + 1)), SamplingParams(2), "warm")
    rng = random.Random(0)
    stop = time.perf_counter() + args.duration
    counted = 0
    latencies: list[float] = []

    async def client(i: int) -> None:
        nonlocal counted
        while time.perf_counter() < stop:
            prompt = [rng.randrange(1, MODEL["vocab_size"]) for _ in range(rng.randint(16, 128))]
            params = SamplingParams(rng.randint(16, 256), temperature=1.0, seed=rng.randrange(2**31))
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
    stats = engine.stats()
    await engine.shutdown()
    row = {"swap mode": mode, "tokens/s": counted / elapsed, "swaps": len(latencies),
           "mean swap s": statistics.mean(latencies) if latencies else 0.0,
           "max swap s": max(latencies, default=0.0), "re-prefills": stats["reprefills"]}
    print(f"{mode}: {row['tokens/s']:.0f} tokens/s, {row['swaps']} swaps, "
          f"mean update call {row['mean swap s']:.2f} s", flush=True)
    return row


# Report -------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: "—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="requests at once = engine slots")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per swap mode")
    parser.add_argument("--update-every", type=float, default=2.0, help="seconds between updates")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop request streams")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        paths = write_models(Path(root))
        decode_rows = asyncio.run(decode_benchmark(paths[0], args))
        swap_rows = [asyncio.run(swap_benchmark(paths, mode, args)) for mode in ("interrupt", "drain")]
    decode_table, swap_table = table(decode_rows), table(swap_rows)
    print(decode_table, swap_table, sep="\n\n")
    command = "PYTHONPATH=. python benchmarks/engine.py " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# JAX engine benchmark\n\nCommand: `{command.strip()}`\n\n"
        f"Machine: {platform.machine()} CPU, {jax.device_count()} JAX device(s) "
        f"({jax.default_backend()}), JAX {jax.__version__}.\n\n"
        f"## Decode throughput ({args.batch} requests, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens each)\n\n{decode_table}\n\n"
        f"## Weight swaps under load ({args.clients} clients, prompts 16–128, outputs 16–256 "
        f"tokens, an update every {args.update_every:g} s, {args.duration:g} s per mode)\n\n"
        f"{swap_table}\n"
    )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
