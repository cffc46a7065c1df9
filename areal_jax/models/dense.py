"""Dense projections as one 2-D matrix product."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *in] times w [*in, *out] -> [..., *out], ``in`` being w's first ``n_in`` dims.

    Computed as one 2-D product of x flattened to [tokens, in]: with the batch and sequence
    dims kept apart (an einsum such as ``btd,df->btf``), the weight gradient contracts two
    dims, and XLA's CPU backend then writes a transposed copy of the output gradient for it
    (the SiLU backward fused with a [F, tokens] write: a quarter of an equal-length train step
    on the 2-core CPU, ``benchmarks/results/train_step.md``). The product accumulates into
    fp32 whatever the operands, then is cast to ``out_dtype`` (default: the operands' type):
    for bf16 operands XLA's CPU backend reaches a CPU's bf16 matrix units (AMX) only with an
    fp32 result.
    """
    lead, din, dout = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    y = jnp.dot(x.reshape(-1, math.prod(din)), w.reshape(math.prod(din), math.prod(dout)),
                preferred_element_type=jnp.float32)
    return y.astype(out_dtype or jnp.result_type(x, w)).reshape(*lead, *dout)
