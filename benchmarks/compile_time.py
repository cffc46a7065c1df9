"""Compile time of the packed training forward (+ backward) against model depth and row length.

Depth: with ``scan_layers`` (the default) the layers run in a ``lax.scan``, so compile time
should stay flat as depth grows; unrolled (``scan_layers=False``) it grows with depth.
Row length (``--lengths``): the same number of tokens packed into fewer, longer rows; packed
attention's program has a fixed size, so compile time should stay flat in row length. Also
reports the compiled step's run time (median of ``--steps``). Cold compiles: the persistent
compilation cache is off.
Usage: python benchmarks/compile_time.py [--layers 2 8 32] [--lengths 512 1024 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import ModelConfig, init_model


def _model(num_layers: int, scan_layers: bool):
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": num_layers, "num_attention_heads": 8, "num_key_value_heads": 4})
    return nnx.split(init_model(cfg, scan_layers=scan_layers))


def _packed_rows(rows: int, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows of ``length`` tokens, each packing three sequences and a padded tail."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 1024, (rows, length))
    segments, positions = np.zeros((rows, length), np.int32), np.zeros((rows, length), np.int32)
    for row in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, length), 3, replace=False))
        for seg, (a, e) in enumerate(zip([0, *cuts[:2]], cuts), start=1):
            segments[row, a:e], positions[row, a:e] = seg, np.arange(e - a)
    return jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)


def _loss_fn(graphdef, tokens, segments, positions):
    def loss(state):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, segments, positions)
        return (m.logits(hidden) * (segments != 0)[..., None]).mean()
    return loss


def compile_seconds(num_layers: int, with_grad: bool, scan_layers: bool) -> float:
    graphdef, state = _model(num_layers, scan_layers)
    tokens = jnp.zeros((4, 256), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(256), tokens.shape)
    loss = _loss_fn(graphdef, tokens, jnp.ones_like(tokens), positions)
    fn = jax.jit(jax.grad(loss) if with_grad else loss)
    start = time.perf_counter()
    fn.lower(state).compile()
    return time.perf_counter() - start


def length_row(length: int, tokens_total: int, num_layers: int, steps: int) -> tuple[float, float]:
    """(forward+backward compile seconds, median step ms) for rows of ``length`` tokens."""
    graphdef, state = _model(num_layers, scan_layers=True)
    batch = _packed_rows(max(1, tokens_total // length), length)
    start = time.perf_counter()
    fn = jax.jit(jax.grad(_loss_fn(graphdef, *batch))).lower(state).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(fn(state))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - start)
    return compile_s, 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--lengths", type=int, nargs="*", default=[],
                        help="row lengths to measure instead of depths (4 layers)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (--lengths)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per length")
    args = parser.parse_args()
    if args.lengths:
        print(f"{'rows x length':>14} {'fwd+bwd compile s':>18} {'step ms':>9}")
        for length in args.lengths:
            compile_s, step_ms = length_row(length, args.tokens, 4, args.steps)
            shape = f"{max(1, args.tokens // length)} x {length}"
            print(f"{shape:>14} {compile_s:>18.2f} {step_ms:>9.1f}", flush=True)
        return
    print(f"{'layers':>6} {'scan_layers':>11} {'forward s':>10} {'fwd+bwd s':>10}")
    for n in args.layers:
        for scan in (True, False):
            fwd, bwd = compile_seconds(n, False, scan), compile_seconds(n, True, scan)
            print(f"{n:>6} {str(scan):>11} {fwd:>10.2f} {bwd:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
