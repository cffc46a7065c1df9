"""Compile time of the packed training forward (+ backward) against model depth.

With ``scan_layers`` (the default) the layers run in a ``lax.scan``, so compile time should stay
flat as depth grows; unrolled (``scan_layers=False``) it grows with depth. Cold compiles: the
persistent compilation cache is off.
Usage: python benchmarks/compile_time.py [--layers 2 8 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models import ModelConfig, init_model


def compile_seconds(num_layers: int, with_grad: bool, scan_layers: bool) -> float:
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": num_layers, "num_attention_heads": 8, "num_key_value_heads": 4})
    model = init_model(cfg, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((4, 256), jnp.int32)

    def loss(state):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(256), tokens.shape))
        return m.logits(hidden).mean()

    fn = jax.jit(jax.grad(loss) if with_grad else loss)
    start = time.perf_counter()
    fn.lower(state).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    args = parser.parse_args()
    print(f"{'layers':>6} {'scan_layers':>11} {'forward s':>10} {'fwd+bwd s':>10}")
    for n in args.layers:
        for scan in (True, False):
            fwd, bwd = compile_seconds(n, False, scan), compile_seconds(n, True, scan)
            print(f"{n:>6} {str(scan):>11} {fwd:>10.2f} {bwd:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
