"""Dense projections as one 2-D matrix product."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


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

    The gradient's two products take their operands in the forward operands' type too: the
    incoming gradient is cast to it first. Without the cast, the gradient of the fp32
    accumulation is fp32 for every bf16 projection (and the log-prob head's fp32 logits give
    it one anyway), so both backward products would be fp32, which a GPU runs as TF32 products
    at a fraction of the bf16 rate (measured on an H200: 40 of 179 ms of a
    Qwen2.5-0.5B-shaped train step, ``benchmarks/results/gpu.md``). This is what PyTorch's
    autocast does. fp32 operands are unaffected.

    The result is named ``"dense"`` (``jax.ad_checkpoint.checkpoint_name``), so a remat policy
    can save it: the product inside the custom gradient is hidden from policies that look
    for matrix products.
    """
    lead, din, dout = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, w))
    y = _product(x.reshape(-1, math.prod(din)), w.reshape(math.prod(din), math.prod(dout)),
                 out_dtype)
    return checkpoint_name(y, "dense").reshape(*lead, *dout)


_ROWS = (((1,), (0,)), ((), ()))  # [n, k] x [k, m]
_ROWS_T = (((1,), (1,)), ((), ()))  # [n, m] x [k, m]: the input gradient
_TOKENS = (((0,), (0,)), ((), ()))  # [n, k] x [n, m]: the weight gradient


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """x [n, k] @ w [k, m], accumulated in fp32, cast to ``out_dtype``."""
    return jax.lax.dot_general(x, w, _ROWS, preferred_element_type=jnp.float32).astype(out_dtype)


def _product_forward(x, w, out_dtype):
    return _product(x, w, out_dtype), (x, w)


def _product_backward(out_dtype, residuals, g):
    x, w = residuals
    g = g.astype(jnp.result_type(x, w))
    dx = jax.lax.dot_general(g, w, _ROWS_T, preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(x, g, _TOKENS, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_product.defvjp(_product_forward, _product_backward)
