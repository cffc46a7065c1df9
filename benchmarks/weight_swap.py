"""Cost of the parts of a weight swap on this machine; records numbers, asserts nothing.

For each model and export dtype, the median of ``--reps`` warm runs (one untimed run first
compiles the conversions) of:
- snapshot: ``hf_state_dict`` (cast and lay out on device, copy to host);
- write: ``export_hf_tensors`` of that snapshot (safetensors files synced to disk, atomic
  rename: what ``areal-jax export`` writes);
- load: ``rollout.engines.jax_weights.load_params`` of the export, as the JAX engine loads an
  update (validate headers, read, check finiteness, convert, place on device, cast);
- raw read: reading the same safetensors files into preallocated memory: what moving the
  bytes alone costs. The load reads through a memory map instead, so it can come close to or
  under this when it copies no more than once.
Files are read from the page cache (they were just written); throughput is file bytes / s.

``--parts whole`` measures the whole swap as the RL loop runs it, against a rollout server
subprocess (JAX engine, serving dtype fp32) started as the controller starts local servers:
export (snapshot + write, not synced to disk, as the RL loop publishes) of new weights, then
``UpdateWeights`` with the export's path (the server reads, checks, converts and places them,
then swaps between two decode calls) and ``PushWeights`` of the same files (streamed over
gRPC into the server's push directory first: the transfer). The update call returns once the
server generates with the new weights, so export + update is the time from the end of a train
step until every server serves the new version. Model: the "25M" shape with the tiny-model
kit's tokenizer (vocabulary 512, so 19M parameters). Re-prefill of requests in flight at the
swap is measured by ``benchmarks/paper/interrupt_vs_drain.py``.

Models (random weights, qwen2 architecture): "tiny" is the tiny-model kit's default (hidden 128,
4 layers, vocabulary 512, tied head); "25M" is hidden 512, 6 layers, 8 / 4 heads, MLP 1536,
vocabulary 6144, untied head.

Usage: PYTHONPATH=. python benchmarks/weight_swap.py [--reps 5] [--parts parts whole]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from areal_jax.controller.local_servers import LocalServers
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.models import ModelConfig, export_hf_tensors, hf_state_dict, init_model
from areal_jax.models.tiny import TinyModelSpec, build_tiny_model
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


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def parts_table(reps: int) -> None:
    header = ("model", "params", "dtype", "file MB", "snapshot s", "write s", "export MB/s",
              "load s", "load MB/s", "raw read s", "raw read MB/s", "load / raw read")
    print(_row(header))
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            for dtype in ("float32", "bfloat16"):
                r = measure(name, dtype, Path(tmp), reps)
                export = r["snap"] + r["write"]
                row = (r["model"], f"{r['params'] / 1e6:.1f}M", dtype, f"{r['mb']:.1f}",
                       f"{r['snap']:.4f}", f"{r['write']:.4f}", f"{r['mb'] / export:.0f}",
                       f"{r['load']:.4f}", f"{r['mb'] / r['load']:.0f}", f"{r['read']:.4f}",
                       f"{r['mb'] / r['read']:.0f}", f"{r['load'] / r['read']:.1f}x")
                print(_row(row), flush=True)


async def _swaps(pool: RolloutPool, model, cfg: ModelConfig, root: Path, reps: int) -> dict:
    """Median seconds of each part over ``reps`` swaps (one untimed swap first)."""
    times: dict[str, list[float]] = {"export": [], "update": [], "push": [], "read": []}
    for k in range(reps + 1):
        out = root / "exports" / f"v{k}"
        t0 = time.perf_counter()
        export_hf_tensors(hf_state_dict(model, "float32"), cfg, out, durable=False)
        t1 = time.perf_counter()
        await pool.update_weights(out, 2 * k + 1)
        t2 = time.perf_counter()
        await pool.update_weights(out, 2 * k + 2, push=True)
        t3 = time.perf_counter()
        files = sorted(out.glob("*.safetensors"))
        buffers = [bytearray(f.stat().st_size) for f in files]
        t4 = time.perf_counter()
        raw_read(files, buffers)
        t5 = time.perf_counter()
        if k:
            for part, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
                times[part].append(seconds)
        times.setdefault("mb", []).append(sum(f.stat().st_size for f in files) / 1e6)
    return {part: statistics.median(v) for part, v in times.items()}


def whole_table(reps: int) -> None:
    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
                         num_kv_heads=4, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_tiny_model(root / "base", spec)
        cfg = ModelConfig.from_pretrained(base)
        model = init_model(cfg, seed=1)
        server = {"engine": {"kind": "jax", "model_path": str(base), "initial_version": 0,
                             "options": {"num_slots": 8, "max_seq_len": 256}}}

        async def run() -> dict:
            with LocalServers(server, 1, root / "logs") as servers:
                pool = RolloutPool(servers.addresses)
                await pool.start(ready_timeout_s=300)
                try:
                    return await _swaps(pool, model, cfg, root, reps)
                finally:
                    await pool.close()

        r = asyncio.run(run())
    whole, pushed = r["export"] + r["update"], r["export"] + r["push"]
    header = ("params", "file MB", "export s", "update (path) s", "push s", "transfer s",
              "raw read s", "whole swap, path: s, MB/s, vs raw read",
              "whole swap, push: s, MB/s, vs raw read")
    print(_row(header))
    print("|" + "---|" * len(header))
    mb = r["mb"]
    print(_row((f"{cfg.num_params() / 1e6:.1f}M", f"{mb:.1f}", f"{r['export']:.3f}",
                f"{r['update']:.3f}", f"{r['push']:.3f}", f"{r['push'] - r['update']:.3f}",
                f"{r['read']:.4f}",
                f"{whole:.3f}, {mb / whole:.0f}, {r['read'] / whole:.1%}",
                f"{pushed:.3f}, {mb / pushed:.0f}, {r['read'] / pushed:.1%}")), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--parts", nargs="+", choices=("parts", "whole"),
                        default=["parts", "whole"])
    args = parser.parse_args()
    device = jax.devices()[0].platform
    print(f"Machine: {platform.machine()} CPU, {len(jax.devices())} JAX device(s) ({device}), "
          f"JAX {jax.__version__}; median of {args.reps} warm runs\n")
    if "parts" in args.parts:
        parts_table(args.reps)
    if "whole" in args.parts:
        print()
        whole_table(args.reps)


if __name__ == "__main__":
    main()
