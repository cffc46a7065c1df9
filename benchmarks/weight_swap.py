"""Cost of the parts of a weight swap on this machine; records numbers, asserts nothing.

For each model and export dtype, the median of ``--reps`` warm runs (one untimed run first
compiles the conversions) of:
- snapshot: ``hf_state_dict`` (cast and lay out on device, copy to host);
- write: ``export_hf_tensors`` of that snapshot (safetensors files with fsync, atomic rename);
- load: ``rollout.engines.jax_weights.load_params`` of the export, as the JAX engine loads an
  update (validate headers, read, check finiteness, convert, place on device, cast);
- raw read: reading the same safetensors files into preallocated memory: what moving the
  bytes alone costs. The load reads through a memory map instead, so it can come close to or
  under this when it copies no more than once.
Files are read from the page cache (they were just written); throughput is file bytes / s.

Models (random weights, qwen2 architecture): "tiny" is the tiny-model kit's default (hidden 128,
4 layers, vocabulary 512, tied head); "25M" is hidden 512, 6 layers, 8 / 4 heads, MLP 1536,
vocabulary 6144, untied head.

Usage: PYTHONPATH=. python benchmarks/weight_swap.py [--reps 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from areal_jax.models import ModelConfig, export_hf_tensors, hf_state_dict, init_model
from rollout.engines.jax_weights import load_params

MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "25M": dict(vocab_size=6144, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
}
ENGINE_DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def timed(fn, reps: int) -> tuple[float, object]:
    """(median seconds of ``reps`` warm calls, last result); one untimed call first."""
    result = fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def raw_read(files: list[Path], buffers: list[bytearray]) -> int:
    """Read each file whole into its preallocated buffer; bytes read."""
    total = 0
    for f, buf in zip(files, buffers):
        with open(f, "rb", buffering=0) as fh:
            total += fh.readinto(buf)
    return total


def measure(name: str, dtype: str, root: Path, reps: int) -> dict:
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen2", **MODELS[name]})
    model = init_model(cfg, seed=0)
    out = root / f"{name}-{dtype}"
    snap_s, tensors = timed(lambda: hf_state_dict(model, dtype), reps)
    write_s, _ = timed(lambda: export_hf_tensors(tensors, cfg, out), reps)
    files = sorted(out.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    load_s, _ = timed(lambda: load_params(str(out), cfg, ENGINE_DTYPE[dtype]), reps)
    buffers = [bytearray(f.stat().st_size) for f in files]
    read_s, _ = timed(lambda: raw_read(files, buffers), reps)
    return dict(model=name, params=cfg.num_params(), dtype=dtype, mb=nbytes / 1e6,
                snap=snap_s, write=write_s, load=load_s, read=read_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices()[0].platform
    print(f"Machine: {platform.machine()} CPU, {len(jax.devices())} JAX device(s) ({device}), "
          f"JAX {jax.__version__}; median of {args.reps} warm runs\n")
    header = ("model", "params", "dtype", "file MB", "snapshot s", "write s", "export MB/s",
              "load s", "load MB/s", "raw read s", "raw read MB/s", "load / raw read")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            for dtype in ("float32", "bfloat16"):
                r = measure(name, dtype, Path(tmp), args.reps)
                export = r["snap"] + r["write"]
                row = (r["model"], f"{r['params'] / 1e6:.1f}M", dtype, f"{r['mb']:.1f}",
                       f"{r['snap']:.4f}", f"{r['write']:.4f}", f"{r['mb'] / export:.0f}",
                       f"{r['load']:.4f}", f"{r['mb'] / r['load']:.0f}", f"{r['read']:.4f}",
                       f"{r['mb'] / r['read']:.0f}", f"{r['load'] / r['read']:.1f}x")
                print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
