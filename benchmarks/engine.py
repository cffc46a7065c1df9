"""JAX generation engine throughput on this machine; records numbers, asserts nothing.

1. Decode throughput, for each of two qwen2-shaped models with random weights (0.6M
   parameters: hidden 128, 4 layers, MLP 256; 23M: hidden 512, 8 layers, MLP 1408; both
   vocabulary 512, 8 heads / 2 KV heads, tied embeddings, no end-of-sequence id so every
   request runs to its token budget):
   - the JAX engine against transformers ``generate`` on the same prompts, batch and token
     budget, greedy and T=1 (transformers with one torch thread and with its default; the
     faster counts);
   - the engine on ragged requests (twice as many as slots, outputs uniform from 1/8 of the
     budget to all of it) against the same requests at equal lengths (the mean), greedy, with
     the share of wall time spent in prefill calls and the mean batch a decode call computed;
     and the ragged requests on an engine whose decode calls always compute every slot
     (``batch_buckets: [slots]``), to show what computing only the live batch buys;
   - the same comparison on a stream (``--stream-factor`` times as many requests as slots),
     closer to an RL run, where the servers always have more requests than slots: the tail of
     a finite batch then matters little, and what is left is the cost of admitting requests
     one by one and of attention windows set by the longest live sequence.
   ``--dtype bfloat16`` runs both sides in bfloat16 (the engine's ``dtype`` option, the
   transformers model loaded in it).
   All sides are timed round-robin in one process; medians; the engine's compile time (first
   run minus a warm run) is reported on its own.
2. Weight swaps under load: closed-loop clients keep a stream of requests going (prompts of 16
   to 128 tokens, outputs long-tailed as in RL: log-uniform from 16 to 768 tokens) while a new
   checkpoint arrives every ``--update-every`` seconds; tokens/s with interruptible swaps
   (re-prefill and continue) against wait-for-drain swaps, in alternating segments, on a 4.2M
   model (hidden 256, 4 layers, 8 heads / 4 KV heads, MLP 768, vocabulary 2048, untied).

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

SHAPE = {"model_type": "qwen2", "vocab_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": True,
         "eos_token_id": None}  # fmt: skip
DECODE_MODELS = {  # the decode benchmark's models, by parameter count
    "0.6M": {**SHAPE, "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256},
    "23M": {**SHAPE, "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1408},
}
VOCAB = SHAPE["vocab_size"]
SWAP_MODEL = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256,
              "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "max_position_embeddings": 1024,
              "tie_word_embeddings": False, "eos_token_id": None}  # fmt: skip
RESULTS = Path(__file__).parent / "results" / "engine.md"
MAX_PROMPT = 128  # prompts of the swap benchmark: 16 to 128 tokens


def write_models(root: Path, model: dict, count: int, dtype: str = "float32") -> list[str]:
    """``count`` random checkpoints of ``model`` in ``dtype`` (the swap benchmark alternates
    two)."""
    cfg = ModelConfig.from_hf_dict(model)
    paths = []
    for i in range(count):  # one model in memory at a time
        m = init_model(cfg, seed=i, dtype=jnp.dtype(dtype))
        paths.append(str(export_hf(m, root / f"m{i}", dtype=dtype)))
        del m
    return paths


async def engine_for(path: str, **options):
    engine = create_engine(EngineConfig(kind="jax", model_path=path, options=options))
    await engine.start()
    return engine


# 1. Decode throughput -----------------------------------------------------------------------


SAMPLING = {"greedy": {}, "T=1": {"temperature": 1.0}}


def sampling(kind: str, n: int) -> SamplingParams:
    return SamplingParams(n, **{"temperature": 0.0, **SAMPLING[kind]})


async def jax_batch(engine, prompts, kind: str, lengths: list[int]) -> float:
    """Seconds to generate ``lengths[i]`` tokens for every prompt ``i``, all submitted at once."""
    start = time.perf_counter()
    results = await asyncio.gather(*[
        engine.generate_full(p, sampling(kind, n), f"b{i}")
        for i, (p, n) in enumerate(zip(prompts, lengths))])
    elapsed = time.perf_counter() - start
    assert [len(r.output_ids) for r in results] == lengths
    return elapsed


def hf_batch(model, prompts, kind: str, n: int) -> float:
    import torch

    ids = torch.tensor(prompts, device=model.device)
    kw = dict(do_sample=False)
    if kind != "greedy":  # top_k=0 turns off transformers' default top-k of 50
        kw = {"do_sample": True, "top_k": 0, "top_p": 1.0, **SAMPLING[kind]}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, **kw).cpu()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + n
    return elapsed


def schedule_cost(lengths: list[int], slots: int, steps: int, buckets: list[int]) -> int:
    """Rows computed to decode ``lengths`` FIFO on ``slots`` slots, admitting only between
    calls of ``steps`` steps, each call computing the smallest of ``buckets`` that holds the
    live sequences: the engine's schedule with prefill and host work taken as free."""
    queue, live, rows = list(lengths), [], 0
    while queue or live:
        while queue and len(live) < slots:
            live.append(queue.pop(0))
        rows += steps * next(b for b in sorted(buckets) if b >= len(live))
        live = [n - steps for n in live if n > steps]
    return rows


def ragged_ceilings(equal: list[int], ragged: list[int], live_buckets: list[int], args) -> dict:
    """Ragged / equal throughput of that ideal schedule when every call computes every slot,
    and when it computes the live batch's bucket of ``live_buckets`` (cost per row)."""
    def ratio(buckets):
        cost = lambda lengths: schedule_cost(lengths, args.batch, args.steps_per_call, buckets)  # noqa: E731
        return cost(equal) / cost(ragged)

    return {"every slot": ratio([args.batch]), "live batch": ratio(live_buckets)}


async def decode_benchmark(path, args) -> tuple[list[dict], list[dict], list[dict]]:
    """Rows of three tables: the JAX engine against transformers (equal lengths), the engine
    on ragged against equal lengths, and compile times. All sides are timed round-robin
    (median of ``--reps`` rounds), so load from other processes hits every side alike."""
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    prompts = rng.integers(1, VOCAB, (args.batch, args.prompt_len)).tolist()
    # Ragged: twice as many requests as slots, outputs uniform in [new/8, new]; equal: the same
    # requests with every output the mean length (the same number of tokens).
    ragged = rng.integers(args.new_tokens // 8, args.new_tokens + 1, 2 * args.batch).tolist()
    equal = [round(statistics.mean(ragged))] * len(ragged)
    ragged_prompts = rng.integers(1, VOCAB, (len(ragged), args.prompt_len)).tolist()
    stream = rng.integers(args.new_tokens // 8, args.new_tokens + 1,
                          args.stream_factor * args.batch).tolist()
    stream_equal = [round(statistics.mean(stream))] * len(stream)
    stream_prompts = rng.integers(1, VOCAB, (len(stream), args.prompt_len)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    thread_counts = sorted({1, torch.get_num_threads()})  # one thread is often faster here
    options = dict(num_slots=args.batch, dtype=args.dtype,
                   max_seq_len=1 << (args.prompt_len + args.new_tokens - 1).bit_length(),
                   decode_steps_per_call=args.steps_per_call,
                   prefill_buckets=args.prefill_buckets)
    engine = await engine_for(path, **options)
    every_slot = await engine_for(path, **options, batch_buckets=[args.batch])
    sides = {"equal": (engine, equal, ragged_prompts), "ragged": (engine, ragged, ragged_prompts),
             "ragged, every slot computed": (every_slot, ragged, ragged_prompts),
             "equal, stream": (engine, stream_equal, stream_prompts),
             "ragged, stream": (engine, stream, stream_prompts)}
    n = [args.new_tokens] * args.batch
    first = await jax_batch(engine, prompts, "greedy", n)
    warm = await jax_batch(engine, prompts, "greedy", n)
    compile_rows = [{"first run s": first, "warm run s": warm,
                     "compile s (difference)": first - warm}]
    for kind in SAMPLING:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            hf_batch(hf, prompts, kind, 8)  # warm-up
        await jax_batch(engine, prompts, kind, [8] * args.batch)
    for side, lengths, side_prompts in sides.values():
        await jax_batch(side, side_prompts, "greedy", lengths)
    times: dict[tuple, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    batch: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for kind in SAMPLING:
            for threads in thread_counts:
                torch.set_num_threads(threads)
                t = hf_batch(hf, prompts, kind, args.new_tokens)
                times.setdefault((f"transformers, {threads} thread(s)", kind), []).append(t)
            times.setdefault(("JAX engine", kind), []).append(
                await jax_batch(engine, prompts, kind, n))
        for name, (side, lengths, side_prompts) in sides.items():
            before = side.stats()
            t = await jax_batch(side, side_prompts, "greedy", lengths)
            after = side.stats()
            times.setdefault(("JAX engine", name), []).append(t)
            prefill.setdefault(name, []).append(
                (after["prefill_seconds"] - before["prefill_seconds"]) / t)
            batch.setdefault(name, []).append(
                (after["decode_rows"] - before["decode_rows"])
                / (after["decode_calls"] - before["decode_calls"]))
        print(f"round {rep + 1}/{args.reps} done", flush=True)
    await engine.shutdown()
    await every_slot.shutdown()
    rate = lambda key, tokens: tokens / statistics.median(times[key])
    rows = []
    for kind in SAMPLING:
        hf_best = max(rate((f"transformers, {t} thread(s)", kind), sum(n)) for t in thread_counts)
        jax_rate = rate(("JAX engine", kind), sum(n))
        rows.append({"sampling": kind, "transformers tokens/s (faster thread count)": hf_best,
                     "JAX engine tokens/s": jax_rate, "JAX / transformers": jax_rate / hf_best})
    ragged_rows = [{"lengths": name, "requests": len(lengths), "tokens": sum(lengths),
                    "tokens/s": rate(("JAX engine", name), sum(lengths)),
                    "prefill share of wall time": statistics.median(prefill[name]),
                    "mean decode batch": statistics.median(batch[name])}
                   for name, (_, lengths, _) in sides.items()]
    ceilings = {"batch": ragged_ceilings(equal, ragged, engine.options.batch_buckets, args),
                "stream": ragged_ceilings(stream_equal, stream, engine.options.batch_buckets,
                                          args)}
    return rows, ragged_rows, compile_rows, ceilings


# 2. Weight swaps under load -----------------------------------------------------------------


async def swap_segment(paths, mode: str, seconds: float, seed: int, warm: bool, args,
                       updates: bool = True, vocab: int = SWAP_MODEL["vocab_size"]) -> dict:
    """One timed stretch of load with updates in ``mode`` (none unless ``updates``): tokens,
    seconds, update call times, the engine's start time (loading, and compiling where
    ``warm``), and its prefill and decode counters.

    ``warm`` first compiles every program the engine can call (``precompile``: every prefill
    bucket, every decode window at every batch bucket; compiled programs are shared by later
    engines in the process), so no timed segment waits for a compile."""
    seq_len = 1 << (MAX_PROMPT + args.max_new - 1).bit_length()
    starting = time.perf_counter()
    engine = await engine_for(paths[0], num_slots=args.swap_slots, max_seq_len=seq_len,
                              decode_steps_per_call=8, swap_mode=mode, precompile=warm)
    start_seconds = time.perf_counter() - starting
    rng = random.Random(seed)
    stop = time.perf_counter() + seconds
    counted = 0
    latencies: list[float] = []

    async def client(i: int) -> None:
        nonlocal counted
        while time.perf_counter() < stop:
            length = rng.randint(16, MAX_PROMPT)
            prompt = [rng.randrange(1, vocab) for _ in range(length)]
            n = int(math.exp(rng.uniform(math.log(args.min_new), math.log(args.max_new))))
            params = SamplingParams(n, temperature=1.0, seed=rng.randrange(2**31))
            async with contextlib.aclosing(engine.generate(prompt, params, f"c{i}")) as chunks:
                async for chunk in chunks:
                    if time.perf_counter() >= stop:
                        return
                    counted += len(chunk.token_ids)

    async def updater() -> None:
        version, start = 0, time.perf_counter()
        while updates:
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
    return {"tokens": counted, "seconds": elapsed, "latencies": latencies,
            "start_seconds": start_seconds,
            **{k: stats[k] for k in ("reprefills", "prefill_calls", "prefill_seconds",
                                     "decode_calls", "decode_rows")}}


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
    fmt = lambda v: (f"{v:.2f}" if abs(v) >= 0.1 or v == 0 else f"{v:.2e}"  # noqa: E731
                     ) if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


GOALS = {"0.6M": 5.0, "23M": 2.5}  # JAX engine / transformers, per model
RAGGED_GOAL = 0.85  # ragged / equal tokens/s


def decode_goal(name: str, rows: list[dict], ragged_rows: list[dict], ceilings: dict) -> list[str]:
    """Goals met or not: the engine's speed-up over transformers, and ragged against equal."""
    lines = [f"- {name}, {r['sampling']}: JAX engine {r['JAX / transformers']:.2f}x "
             f"transformers (goal >= {GOALS[name]:g}x: "
             f"{'met' if r['JAX / transformers'] >= GOALS[name] else 'NOT met'})" for r in rows]
    by = {r["lengths"]: r["tokens/s"] for r in ragged_rows}
    for kind, suffix in (("batch", ""), ("stream", ", stream")):
        ratio = by["ragged" + suffix] / by["equal" + suffix]
        ceiling = ceilings[kind]
        lines.append(
            f"- {name}, ragged / equal lengths{suffix}: {ratio:.2f} (goal >= {RAGGED_GOAL:g}: "
            f"{'met' if ratio >= RAGGED_GOAL else 'NOT met'}; the FIFO schedule itself, prefill "
            f"and host work free, allows {ceiling['every slot']:.2f} computing every slot, "
            f"{ceiling['live batch']:.2f} computing the live batch bucket)")
    return lines


def swap_goal(rows: list[dict]) -> list[str]:
    """Goal: interruptible swaps give more tokens/s than waiting for a drain."""
    by_mode = {r["swap mode"]: r["tokens/s"] for r in rows}
    ratio = by_mode["interrupt"] / by_mode["drain"]
    return [f"- weight swaps under load: interrupt {ratio:.2f}x drain "
            f"(goal > 1x: {'met' if ratio > 1 else 'NOT met'})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="requests at once = engine slots")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps-per-call", type=int, default=8)
    parser.add_argument("--stream-factor", type=int, default=8,
                        help="stream side of the ragged comparison: this many requests per slot")
    parser.add_argument("--prefill-buckets", type=int, nargs="+", default=None,
                        help="the engine's prefill_buckets (also its decode attention windows; "
                             "default: powers of two)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="decode benchmark: both sides compute in this dtype")
    parser.add_argument("--models", nargs="+", choices=list(DECODE_MODELS),
                        default=list(DECODE_MODELS))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per swap mode")
    parser.add_argument("--segments", type=int, default=3, help="alternating stretches per mode")
    parser.add_argument("--update-every", type=float, default=2.0, help="seconds between updates")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop request streams")
    parser.add_argument("--swap-slots", type=int, default=8, help="engine slots, swap benchmark")
    parser.add_argument("--min-new", type=int, default=16, help="swap benchmark output lengths: "
                        "log-uniform from --min-new to --max-new (long-tailed, as in RL)")
    parser.add_argument("--max-new", type=int, default=768)
    parser.add_argument("--parts", nargs="+", choices=["decode", "swap"],
                        default=["decode", "swap"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    sections, summary = [], []
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as root:
        if "decode" in args.parts:
            for name in args.models:
                (path,) = write_models(Path(root) / name, DECODE_MODELS[name], 1)
                rows, ragged_rows, compile_rows, ceilings = asyncio.run(
                    decode_benchmark(path, args))
                loads.append(os.getloadavg()[0])
                sections.append(
                    f"## Decode, {name} model, {args.dtype} ({args.batch} slots, prompt "
                    f"{args.prompt_len}, "
                    f"{args.new_tokens} new tokens, {args.steps_per_call} steps per call, "
                    f"median of {args.reps} round-robin rounds)\n\n{table(rows)}\n\n"
                    f"Ragged against equal lengths ({2 * args.batch} requests, and a stream of "
                    f"{args.stream_factor * args.batch}; greedy):\n\n"
                    f"{table(ragged_rows)}\n\nCompile time (greedy, {args.batch} requests):"
                    f"\n\n{table(compile_rows)}")
                summary += decode_goal(name, rows, ragged_rows, ceilings)
        if "swap" in args.parts:
            paths = write_models(Path(root) / "swap", SWAP_MODEL, 2)
            swap_rows = swap_benchmark(paths, args)
            loads.append(os.getloadavg()[0])
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
        f"device(s) ({jax.default_backend()}), JAX {jax.__version__}; 1-minute load average "
        f"{' / '.join(f'{x:.1f}' for x in loads)} (start / after each part).\n\n"
        + "\n\n".join(sections) + "\n"
    )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
