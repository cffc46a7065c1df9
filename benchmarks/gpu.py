"""GPU rows: the JAX engine's decode and the trainer's step in bf16 on one GPU, side by side
with transformers ``generate`` and a PyTorch train step on the same GPU; records numbers,
asserts nothing.

Models: Qwen2.5-0.5B- and 1.5B-shaped qwen2 models with random weights (the shapes decide the
speed; nothing is downloaded), no end-of-sequence id, so every request runs to its budget.

1. Ceilings, measured in the same run: a bf16 [8192, 8192] @ [8192, 8192] product through JAX
   and through PyTorch, and a device-to-device copy through JAX (bytes read + written).
2. Parity: our forward's logits against transformers' on the GPU, both in fp32, on random
   tokens (relative error ||ours - ref|| / ||ref|| and the largest absolute difference).
3. Decode: ``--batch`` prompts of ``--prompt-len`` random tokens, ``--new-tokens`` each, all
   submitted at once; the JAX engine (``dtype: bfloat16``, ``num_slots`` = batch) against
   transformers ``generate`` on the model loaded in bf16, greedy and T=1, timed round-robin in
   one process (median of ``--reps`` rounds; one engine per ``--steps-per-call`` value, all in
   the same rounds); the engine's compile time (first run minus a warm
   run) on its own; and the floor a decode step cannot beat: every weight and the cache read
   once per step at the measured copy speed.
4. Train step: the same batch and loss as ``benchmarks/train_step.py`` (``--rows`` sequences of
   ``--seq`` tokens, standard PPO, AdamW, global-norm clipping); ours is
   ``Trainer.train_on_batch`` with ``dtype: bfloat16`` (fp32 master weights and optimiser
   state), PyTorch runs the transformers model in fp32 under CUDA autocast to bf16. Steps
   alternate between the sides; medians. MFU counts model FLOPs (``step_flops``) against the
   faster of the two measured bf16 products. ``--unrolled`` adds our step with the layers
   unrolled (``scan_layers: false``) as a third side.

JAX takes at most ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default here 0.45) of the GPU, PyTorch
the rest. Each part writes its rows to ``--out`` as soon as it ends, so a run cut short keeps
what it measured; a part that fails is reported with its error and the run goes on.

Usage: PYTHONPATH=. python benchmarks/gpu.py [--models 0.5B 1.5B --batch 64 --prompt-len 128
       --new-tokens 256 --steps-per-call 8 [32] --reps 3 --seq 1024 --steps 5 --unrolled
       --profile --out results/gpu_run.md]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # before JAX starts

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.models import ModelConfig, export_hf, init_model, load_hf_model  # noqa: E402
from benchmarks.engine import SAMPLING, engine_for, hf_batch, jax_batch, table  # noqa: E402
from benchmarks.matmul_floor import seconds  # noqa: E402
from benchmarks.paper.common import machine  # noqa: E402
from benchmarks.profile_train_step import kinds_by_thread  # noqa: E402
from benchmarks.shapes import QWEN25_SHAPES  # noqa: E402
from benchmarks.train_step import make_batch, ours_step, step_flops, torch_step  # noqa: E402

MODELS = {
    **QWEN25_SHAPES,
    # to try the script on a CPU in seconds
    "tiny": {**QWEN25_SHAPES["0.5B"], "vocab_size": 512, "hidden_size": 128,
             "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4},
}  # fmt: skip
TRAIN_ROWS = {"0.5B": 8, "1.5B": 4, "tiny": 4}  # default sequences per train step, per model:
# 8 x 1024 tokens of the 1.5B model did not fit beside the PyTorch side on a 141 GB H200
RESULTS = Path(__file__).parent / "results" / "gpu_run.md"  # results/gpu.md gathers several runs


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# 1. Ceilings --------------------------------------------------------------------------------


def ceilings(n: int, copy_elems: int, reps: int = 10) -> dict:
    """Measured bf16 product rates (JAX, PyTorch) and JAX's device copy bandwidth."""
    import torch

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    product = jax.jit(jnp.matmul)
    jax_s = seconds(lambda: product(a, b).block_until_ready(), reps)
    x = jax.random.normal(jax.random.key(2), (copy_elems,), jnp.bfloat16)
    copy = jax.jit(lambda v: v + 1)
    copy_s = seconds(lambda: copy(x).block_until_ready(), reps)
    gen = torch.Generator(torch_device()).manual_seed(0)
    ta, tb = (torch.randn(n, n, device=torch_device(), dtype=torch.bfloat16, generator=gen)
              for _ in range(2))
    torch_s = seconds(lambda: (ta @ tb, torch_sync()), reps)
    return {"bf16 product, JAX TFLOP/s": 2 * n**3 / jax_s / 1e12,
            "bf16 product, PyTorch TFLOP/s": 2 * n**3 / torch_s / 1e12,
            "copy, JAX GB/s (read + write)": 2 * 2 * copy_elems / copy_s / 1e9}


def peak_tflops(peaks: dict) -> float:
    """The faster of the two measured bf16 product rates: the ceiling MFU is counted against."""
    return max(peaks["bf16 product, JAX TFLOP/s"], peaks["bf16 product, PyTorch TFLOP/s"])


# 2. Parity ----------------------------------------------------------------------------------


def parity(path: str, vocab: int) -> dict:
    """Our fp32 logits against transformers' fp32 logits on the same device kind."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = np.random.RandomState(0).randint(0, vocab, size=(2, 128))
    model, _ = load_hf_model(path)
    seg = jnp.ones(tokens.shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    ours = np.asarray(model.forward_logits(jnp.asarray(tokens), seg, pos), np.float64)
    del model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch_device())
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, device=torch_device())).logits.double().cpu().numpy()
    del hf
    return {"relative error": float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)),
            "max abs difference": float(np.abs(ours - ref).max()),
            "logit std": float(ref.std()),
            "torch fp32 products in TF32": bool(torch.backends.cuda.matmul.allow_tf32)}


# 3. Decode ----------------------------------------------------------------------------------


def decode_floor_ms(cfg: ModelConfig, batch: int, context: int, copy_gbs: float) -> float:
    """Milliseconds a decode step needs to read every bf16 weight once and, for each row, its
    K and V of ``context`` positions, at ``copy_gbs``."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = L * (d * (q + 2 * kv) + q * d + 3 * d * f) + d * cfg.vocab_size
    cache = batch * L * 2 * kv * context
    return 2 * (weights + cache) / (copy_gbs * 1e9) * 1e3


async def decode_rows(path: str, args) -> tuple[list[dict], list[dict], dict | None]:
    """Engine and transformers tokens/s per sampling kind and engine steps per call, the
    engine's compile time per steps-per-call value, and (``--profile``) where one greedy
    batch's device time went, per decode step (the first steps-per-call value)."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = MODELS[args.current]["vocab_size"]
    prompts = np.random.default_rng(0).integers(1, vocab, (args.batch, args.prompt_len)).tolist()
    n = [args.new_tokens] * args.batch
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(torch_device())
    hf.eval()
    engines, compile_rows = {}, []
    for spc in args.steps_per_call:
        engines[spc] = engine = await engine_for(
            path, num_slots=args.batch, dtype="bfloat16", batch_buckets=[args.batch],
            max_seq_len=1 << (args.prompt_len + args.new_tokens - 1).bit_length(),
            decode_steps_per_call=spc, prefill_buckets=[args.prompt_len])
        first = await jax_batch(engine, prompts, "greedy", n)
        warm = await jax_batch(engine, prompts, "greedy", n)
        compile_rows.append({"steps per call": spc, "first run s": first, "warm run s": warm,
                             "compile s (difference)": first - warm})
    for kind in SAMPLING:  # full-length warm-ups: a first full generate ran 2-4x slow on a GPU
        hf_batch(hf, prompts, kind, args.new_tokens)
        for engine in engines.values():
            await jax_batch(engine, prompts, kind, n)
    times: dict[tuple, list[float]] = {}
    for rep in range(args.reps):
        for kind in SAMPLING:
            times.setdefault(("hf", kind), []).append(hf_batch(hf, prompts, kind, args.new_tokens))
            for spc, engine in engines.items():
                times.setdefault((spc, kind), []).append(await jax_batch(engine, prompts, kind, n))
        print(f"  decode round {rep + 1}/{args.reps}", flush=True)
    profile = None
    if args.profile:
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace):
                wall = await jax_batch(engines[args.steps_per_call[0]], prompts, "greedy", n)
            profile = profile_summary(trace, wall, args.new_tokens)
    for engine in engines.values():
        await engine.shutdown()
    del hf
    rows = []
    for kind in SAMPLING:
        hf_s = statistics.median(times[("hf", kind)])
        for spc in args.steps_per_call:
            jax_s = statistics.median(times[(spc, kind)])
            rows.append({"sampling": kind, "steps per call": spc,
                         "transformers tokens/s": sum(n) / hf_s,
                         "JAX engine tokens/s": sum(n) / jax_s, "JAX / transformers": hf_s / jax_s,
                         "JAX ms per step": jax_s / args.new_tokens * 1e3,
                         "transformers ms per step": hf_s / args.new_tokens * 1e3})
    return rows, compile_rows, profile


# 4. Train step ------------------------------------------------------------------------------


def train_rows(path: str, cfg: ModelConfig, args,
               peak_tflops: float) -> tuple[list[dict], dict[str, float], dict | None]:
    """Ours against PyTorch, alternating steps: seconds, tokens/s and MFU per side; the
    seconds from building each of our trainers to the end of its first step (weight load and
    compilation included), by layer loop; and (``--profile``) where our step's
    device time went."""
    sequences = args.rows or TRAIN_ROWS[args.current]
    groups = make_batch(sequences, args.seq, cfg.vocab_size)
    firsts = {}
    start = time.perf_counter()
    ours = ours_step(path, groups, sequences, args.seq, decoupled=False, scan_layers=True,
                     dtype="bfloat16")
    firsts["scanned"] = time.perf_counter() - start
    theirs = torch_step(path, groups, threads=os.cpu_count() or 1, dtype="bfloat16",
                        device=torch_device())
    sides = {"JAX trainer (train_on_batch)": ours,
             "PyTorch (transformers, autocast bf16)": lambda: (theirs(), torch_sync())}
    if args.unrolled:  # the same step with the layers unrolled instead of scanned
        start = time.perf_counter()
        sides["JAX trainer, layers unrolled"] = ours_step(
            path, groups, sequences, args.seq, decoupled=False, scan_layers=False,
            dtype="bfloat16")
        firsts["unrolled"] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.steps):
        for name, step in sides.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    profile = None
    if args.profile:
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace):
                start = time.perf_counter()
                for _ in range(args.steps):
                    ours()
                wall = time.perf_counter() - start
            profile = profile_summary(trace, wall, args.steps)
    tokens = sum(len(t.prompt_ids) + len(t.output_ids) for g in groups for t in g.trajectories)
    flops = step_flops(cfg, groups)
    torch_s = statistics.median(times["PyTorch (transformers, autocast bf16)"])
    rows = []
    for name, samples in times.items():
        s = statistics.median(samples)
        rows.append({"side": name, "s/step": s, "tokens/s": tokens / s,
                     "MFU": flops / s / (peak_tflops * 1e12), "vs PyTorch": torch_s / s})
    return rows, firsts, profile


# Profile ------------------------------------------------------------------------------------


def profile_summary(trace_dir: str, wall_s: float, steps: int, top: int = 12) -> dict:
    """Per thread of the trace with at least 1% of the busiest one's time: milliseconds per
    step in all and in its ``top`` kinds of operation, against the wall time per step."""
    threads = kinds_by_thread(trace_dir)
    busiest = max((sum(c.values()) for c in threads.values()), default=0)
    return {"wall ms per step": wall_s / steps * 1e3, "threads": {
        name: {"ms per step": sum(c.values()) / steps / 1e3,
               "kinds": {k: us / steps / 1e3 for k, us in c.most_common(top)}}
        for name, c in threads.items() if sum(c.values()) >= 0.01 * busiest}}


def profile_section(title: str, profile: dict) -> str:
    """The device threads' time per step, and the busiest device thread's top kinds."""
    device = {k: v for k, v in profile["threads"].items() if k.startswith("/device:")}
    if not device:
        return f"{title}: no device threads in the trace."
    lines = [f"{title}: wall {profile['wall ms per step']:.2f} ms per step; device threads, "
             f"ms per step: " + "; ".join(f"{k} {v['ms per step']:.2f}" for k, v in device.items())]
    name, busiest = max(device.items(), key=lambda kv: kv[1]["ms per step"])
    lines.append(f"\nTop kinds on {name}:\n\n" + table(
        [{"operation": k, "ms per step": v} for k, v in busiest["kinds"].items()]))
    return "\n".join(lines)


# Report -------------------------------------------------------------------------------------


def write(args, header: str, sections: list[str], record: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(header + "\n\n".join(sections) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))


def run_part(name: str, record: dict, fn):
    """``fn()``, with its error recorded (and printed) instead of raised."""
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # a part that fails must not cost the parts after it
        traceback.print_exc()
        record.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        out = None
    gc.collect()  # the part's engine, trainer and models go before the next part starts
    if torch_device() == "cuda":
        import torch

        torch.cuda.empty_cache()
    print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["0.5B", "1.5B"])
    parser.add_argument("--parts", nargs="+", choices=["parity", "decode", "train"],
                        default=["parity", "decode", "train"])
    parser.add_argument("--batch", type=int, default=64, help="decode: requests = engine slots")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[8],
                        help="decode steps per engine call; several values: one engine each, "
                             "timed round-robin in the same rounds")
    parser.add_argument("--reps", type=int, default=3, help="decode rounds")
    parser.add_argument("--rows", type=int, default=None,
                        help="train: sequences per step (default: 8 for 0.5B, 4 for 1.5B)")
    parser.add_argument("--seq", type=int, default=1024, help="train: tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="train: timed steps per side")
    parser.add_argument("--unrolled", action="store_true",
                        help="train: also time our step with the layers unrolled "
                             "(scan_layers: false), as a third side")
    parser.add_argument("--product-size", type=int, default=8192)
    parser.add_argument("--copy-elems", type=int, default=1 << 30)
    parser.add_argument("--profile", action="store_true",
                        help="also trace one greedy batch and --steps of our train steps, and "
                             "report where the device time went")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rows is not None and args.rows % 4:
        parser.error("--rows must be a multiple of 4 (groups of 4)")

    import torch
    import transformers

    host = machine(accelerator=True)
    device = host.get("accelerator") or "the CPU (no accelerator)"
    command = " ".join(["PYTHONPATH=. python benchmarks/gpu.py", *sys.argv[1:]])
    header = (f"# GPU rows\n\nCommand: `{command}`\n\nDevice: {device}; host "
              f"{host['cpu']}, {host['cores']} cores; JAX {jax.__version__}, PyTorch "
              f"{torch.__version__}, transformers {transformers.__version__}; "
              f"{host['date_utc']} UTC.\n\n")
    record: dict = {"command": command, "device": device, "host": host,
                    "versions": {"jax": jax.__version__, "torch": torch.__version__,
                                 "transformers": transformers.__version__}}
    sections: list[str] = []
    peaks = run_part("ceilings", record, lambda: ceilings(args.product_size, args.copy_elems))
    peaks = peaks or {"bf16 product, JAX TFLOP/s": float("nan"),
                      "bf16 product, PyTorch TFLOP/s": float("nan"),
                      "copy, JAX GB/s (read + write)": float("nan")}
    record["ceilings"] = peaks
    sections.append(f"## Ceilings (measured)\n\n{table([peaks])}")
    write(args, header, sections, record)
    for name in args.models:
        args.current = name
        cfg = ModelConfig.from_hf_dict(MODELS[name])
        with tempfile.TemporaryDirectory() as root:
            model = init_model(cfg, seed=0)
            params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
            path = str(export_hf(model, Path(root) / name, dtype="bfloat16"))
            del model
            part = record.setdefault(name, {"parameters": params})
            sections.append(f"## {name}-shaped model ({params / 1e6:.0f}M parameters)")
            if "parity" in args.parts:
                rows = run_part(f"{name} parity", record, lambda: parity(path, cfg.vocab_size))
                if rows:
                    part["parity"] = rows
                    sections.append(f"Logits against transformers, fp32, 2 x 128 random "
                                    f"tokens:\n\n{table([rows])}")
            if "decode" in args.parts:
                out = run_part(f"{name} decode", record,
                               lambda: asyncio.run(decode_rows(path, args)))
                if out:
                    rows, compile_rows, profile = out
                    floor = decode_floor_ms(cfg, args.batch, args.prompt_len + args.new_tokens // 2,
                                            peaks["copy, JAX GB/s (read + write)"])
                    part["decode"] = {"rows": rows, "compile": compile_rows, "floor ms": floor,
                                      "profile": profile}
                    calls = ", ".join(str(spc) for spc in args.steps_per_call)
                    sections.append(
                        f"Decode, bf16: {args.batch} requests of {args.prompt_len} prompt + "
                        f"{args.new_tokens} new tokens, {calls} steps per engine call, median "
                        f"of {args.reps} round-robin rounds:\n\n{table(rows)}\n\n"
                        f"Floor (every weight and the mean context's cache read once per step "
                        f"at the measured copy speed): {floor:.3f} ms per step. Engine compile:"
                        f"\n\n{table(compile_rows)}")
                    if profile:
                        sections.append(profile_section(
                            "Profile of one greedy batch (prefill included)", profile))
            if "train" in args.parts:
                out = run_part(f"{name} train", record, lambda: train_rows(
                    path, cfg, args, peak_tflops(peaks)))
                if out:
                    rows, firsts, profile = out
                    part["train"] = {"rows": rows, "build and first step s": firsts,
                                     "profile": profile}
                    sections.append(
                        f"Train step, bf16 compute, fp32 weights and AdamW state: "
                        f"{args.rows or TRAIN_ROWS[name]} x {args.seq} tokens, standard PPO, "
                        f"median of {args.steps} alternating steps; MFU against the faster "
                        f"measured bf16 product ({peak_tflops(peaks):.0f} TFLOP/s):"
                        f"\n\n{table(rows)}"
                        f"\n\nOur trainer's construction, weight load and first step "
                        f"(compilation included, persistent cache off): "
                        + ", ".join(f"{s:.1f} s {loop}" for loop, s in firsts.items()) + ".")
                    if profile:
                        sections.append(profile_section("Profile of our train step", profile))
            write(args, header, sections, record)
    if record.get("errors"):
        sections.append("## Errors\n\n" + "\n".join(f"- {k}: {v}"
                                                      for k, v in record["errors"].items()))
    write(args, header, sections, record)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
