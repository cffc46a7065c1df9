"""Masked grouped-query attention shared by packed training and cached decoding.

Training passes the packed row itself as keys (mask: same segment, causal by index). Decoding
passes a per-slot KV cache as keys (mask: cache index <= query position). One function serves
both, so the model has a single definition for trainer and engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_causal_mask(segment_ids: jnp.ndarray) -> jnp.ndarray:
    """[B, T, T] bool: query i sees key j iff j <= i and both are in the same non-pad segment."""
    t = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    valid = (segment_ids != 0)[:, :, None]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return same & valid & causal[None]


def cache_mask(positions: jnp.ndarray, cache_len: int) -> jnp.ndarray:
    """[B, T, S] bool: a query at position p sees cache entries 0..p of its own slot."""
    return jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Softmax attention with GQA.

    q [B, T, Hq, Dh], k/v [B, S, Hkv, Dh], mask [B, T, S] -> [B, T, Hq, Dh].
    Scores and softmax in fp32; fully masked rows (padding) give finite garbage, never NaN.
    """
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, dh).astype(q.dtype)
