"""Grouped-query attention for packed training and for cached decoding.

- ``packed_attention``: a packed row attends to itself (same segment, causal by index). Query
  blocks are computed one at a time against only the keys up to the block's end, so the
  masked upper triangle of the score matrix is mostly never computed (about half the work and
  memory of full ``[T, T]`` scores).
- ``cached_attention``: the tokens of a call attend to the cache entries written by earlier
  calls plus their own keys. The cache is only read here; the caller writes the new keys
  once, after all layers, so a decode step never copies the cache.

Scores and softmax are fp32. Fully masked query rows (padding) give finite garbage, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MIN_BLOCK = 64  # query rows per block in packed attention
_MAX_BLOCKS = 32  # longer rows get proportionally larger blocks (bounded program size)


def _attend(q: jax.Array, pieces: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Softmax attention of q [B, T, Hq, Dh] over the concatenation of key pieces.

    Each piece is (k [B, Hkv, S, Dh], v [B, Hkv, S, Dh], mask [B, T, S] bool); the softmax
    runs over all pieces' keys together. Returns [B, T, Hq, Dh] in q's dtype.
    """
    b, t, hq, dh = q.shape
    hkv = pieces[0][0].shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = [
        jnp.where(
            mask[:, None, None],
            jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
            * (dh**-0.5),
            jnp.finfo(jnp.float32).min,
        )
        for k, _, mask in pieces
    ]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, start = 0.0, 0
    for k, v, _ in pieces:
        p = probs[..., start : start + k.shape[2]].astype(v.dtype)
        # probs @ v as a plain [g*t, s] x [s, d] product per (batch, head): with v as the left
        # operand (einsum's choice here) XLA's CPU backend runs a slow transposed-operand dot.
        p = p.reshape(b, hkv, -1, k.shape[2])
        dims = (((3,), (2,)), ((0, 1), (0, 1)))
        out = out + jax.lax.dot_general(p, v, dims, preferred_element_type=jnp.float32)
        start += k.shape[2]
    out = out.reshape(b, hkv, hq // hkv, t, dh)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, hq, dh).astype(q.dtype)


def block_size(length: int) -> int:
    """Query rows per block of ``packed_attention`` for rows of ``length`` tokens."""
    return max(_MIN_BLOCK, -(-length // _MAX_BLOCKS))


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    block: int | None = None,
) -> jax.Array:
    """Causal attention inside the segments of packed rows.

    q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh], segment_ids [B, T] (0 = padding) -> [B, T, Hq, Dh].
    Query i sees key j iff j <= i and both carry the same non-zero segment id. ``block``: query
    rows per block (default ``block_size(T)``).
    """
    t = q.shape[1]
    block = block or block_size(t)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    index = jnp.arange(t)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        seg_q, seg_k = segment_ids[:, start:end], segment_ids[:, :end]
        mask = (
            (seg_q[:, :, None] == seg_k[:, None, :])
            & (seg_q != 0)[:, :, None]
            & (index[start:end, None] >= index[None, :end])[None]
        )
        outs.append(_attend(q[:, start:end], [(k[:, :, :end], v[:, :, :end], mask)]))
    return jnp.concatenate(outs, axis=1)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Attention of a call's tokens over earlier cache entries plus the call's own keys.

    q [B, T, Hq, Dh] and k/v [B, T, Hkv, Dh] of this call; cache_k/cache_v [B, Hkv, S, Dh]
    as earlier calls left it; segment_ids/positions [B, T]. Each row's real tokens must sit at
    consecutive positions p0, p0+1, ...: the query at position p sees cache entries 0..p0-1
    (entries from p0 on are stale, about to be overwritten) and this call's tokens at
    positions <= p. With S = 0 (nothing cached) this is ``packed_attention``: a row may then
    pack several segments. Returns [B, T, Hq, Dh].
    """
    s = cache_k.shape[2]
    if s == 0:
        return packed_attention(q, k, v, segment_ids)
    real = segment_ids != 0
    first = jnp.min(jnp.where(real, positions, s), axis=1)  # [B]
    old = jnp.broadcast_to(
        (jnp.arange(s)[None, :] < first[:, None])[:, None, :], (q.shape[0], q.shape[1], s)
    )
    new = real[:, :, None] & real[:, None, :] & (positions[:, :, None] >= positions[:, None, :])
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return _attend(q, [(cache_k.astype(q.dtype), cache_v.astype(q.dtype), old), (k, v, new)])


def decode_attention(
    q: jax.Array, cache_kt: jax.Array, cache_v: jax.Array, positions: jax.Array
) -> jax.Array:
    """One query per row over its cache entries 0..position (its own key already written).

    q [B, 1, Hq, Dh]; cache_kt [B, Hkv, Dh, S] (keys transposed, so that both products are
    plain, untransposed ones for XLA's CPU backend); cache_v [B, Hkv, S, Dh]; positions [B].
    Returns [B, 1, Hq, Dh].
    """
    b, _, hq, dh = q.shape
    hkv = cache_v.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, dh)
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(qg, cache_kt.astype(q.dtype), (((3,), (2,)), batch),
                                 preferred_element_type=jnp.float32) * (dh**-0.5)
    mask = jnp.arange(cache_v.shape[2])[None, :] <= positions[:, None]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache_v.dtype)
    out = jax.lax.dot_general(probs, cache_v, (((3,), (2,)), batch),
                              preferred_element_type=jnp.float32)
    return out.reshape(b, 1, hq, dh).astype(q.dtype)
