"""Grouped-query attention for packed training and for cached decoding.

- ``packed_attention``: a packed row attends to itself (same segment, causal by index). Query
  blocks of 64 rows run in a loop (``lax.scan``) against only the keys up to their group's
  end: the blocks are split into at most 8 contiguous groups, each with one key length, so
  the compiled program has a fixed size whatever the row length, and the masked part of the
  computed scores is at most 1/8 more than the causal triangle itself. The backward pass is
  written by hand, flash-attention style: it recomputes each block's probabilities from the
  saved log-sum-exp instead of storing ``[T, T]`` probabilities, and accumulates key and
  value gradients across blocks. Without a gradient (prefill, log-probs), rows go through in
  chunks small enough for a block's scores to stay in the CPU's caches.
- ``cached_attention``: the tokens of a call attend to the cache entries written by earlier
  calls plus their own keys. The cache is only read here; the caller writes the new keys
  once, after all layers, so a decode step never copies the cache.

Scores and softmax are fp32. Fully masked query rows (padding) never give NaN: zeros in
``packed_attention``, finite garbage in ``cached_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_BLOCK = 64  # query rows per block in packed attention
_GROUPS = 8  # key-length groups in packed attention: one compiled loop body (and backward) each
_CHUNK_BYTES = 4 << 20  # block scores of the rows attended together without a gradient


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


def _groups(blocks: int) -> list[tuple[int, int]]:
    """Split query blocks 0..blocks-1 into at most ``_GROUPS`` contiguous runs [a, e)."""
    bounds = np.unique(np.linspace(0, blocks, min(_GROUPS, blocks) + 1).round().astype(int))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _to_blocks(x: jax.Array, hkv: int, block: int) -> jax.Array:
    """[b, T, Hq, Dh] -> [n, b, hkv, g, block, Dh], T padded to n blocks (scan over axis 0)."""
    b, t, hq, dh = x.shape
    n = -(-t // block)
    x = jnp.pad(x, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    return jnp.transpose(x.reshape(b, n, block, hkv, hq // hkv, dh), (1, 0, 3, 4, 2, 5))


def _from_blocks(x: jax.Array, t: int) -> jax.Array:
    """Inverse of ``_to_blocks``: [n, b, hkv, g, block, Dh] -> [b, t, Hq, Dh]."""
    n, b, hkv, g, block, dh = x.shape
    return jnp.transpose(x, (1, 0, 4, 2, 3, 5)).reshape(b, n * block, hkv * g, dh)[:, :t]


def _group_keys(kt, vt, segment_ids, keys: int):
    """The keys, values and key segment ids [0, keys) one group of query blocks attends to."""
    return kt[:, :, :keys], vt[:, :, :keys], segment_ids[:, :keys]


def _dot(x: jax.Array, y: jax.Array, cx: int, cy: int) -> jax.Array:
    """Batched (over the leading [b, hkv]) product contracting x's axis cx with y's axis cy."""
    return jax.lax.dot_general(x, y, (((cx,), (cy,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)


def _block_probs(qb, sq, start, k, seg_k, lse=None):
    """Scores and probabilities of one query block over keys [0, L).

    qb [b, hkv, g, B, Dh]; sq [b, B]; k [b, hkv, L, Dh]; seg_k [b, L]. Without ``lse`` the block's
    own row max normalises (forward); with it, ``exp(s - lse)`` gives the exact softmax
    (backward). Returns (p [b, hkv, g*B, L] fp32, zero where masked; the row max or ``lse``
    [b, hkv, g*B]).
    """
    b, hkv, g, blk, dh = qb.shape
    keys = k.shape[2]
    mask = (
        (sq[:, :, None] == seg_k[:, None, :])
        & (sq != 0)[:, :, None]
        & ((start + jnp.arange(blk))[:, None] >= jnp.arange(keys)[None, :])[None]
    )
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g, blk, keys)).reshape(b, 1, g * blk, keys)
    s = _dot(qb.reshape(b, hkv, g * blk, dh), k, 3, 3) * (dh**-0.5)
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    m = s.max(-1) if lse is None else lse
    return jnp.where(mask, jnp.exp(s - m[..., None]), 0.0), m


def _packed_forward(q, k, v, segment_ids, block):
    t, hkv = q.shape[1], k.shape[2]
    qs = _to_blocks(q, hkv, block)  # [n, b, hkv, g, B, Dh]
    n = qs.shape[0]
    pad = ((0, 0), (0, n * block - t))
    segment_ids = jnp.pad(segment_ids, pad)
    kt, vt = (jnp.swapaxes(jnp.pad(x, (*pad, (0, 0), (0, 0))), 1, 2) for x in (k, v))
    outs, lses = [], []
    for a, e in _groups(n):
        kk, vv, sk = _group_keys(kt, vt, segment_ids, e * block)

        def body(_, x, kk=kk, vv=vv, sk=sk):
            qb, start = x
            sq = jax.lax.dynamic_slice_in_dim(segment_ids, start, block, axis=1)
            p, m = _block_probs(qb, sq, start, kk, sk)
            total = jnp.maximum(p.sum(-1), jnp.finfo(jnp.float32).tiny)
            o = _dot(p.astype(vv.dtype), vv, 3, 2) / total[..., None]
            return None, (o.reshape(qb.shape).astype(q.dtype), m + jnp.log(total))

        _, (o, lse) = jax.lax.scan(body, None, (qs[a:e], jnp.arange(a, e) * block))
        outs.append(o)
        lses.append(lse)
    o, lse = jnp.concatenate(outs), jnp.concatenate(lses)  # [n, b, hkv, g, B, Dh], [n, b, hkv, g*B]
    return _from_blocks(o, t), (qs, kt, vt, segment_ids, o, lse)


def _packed_backward(block, residuals, d_out):
    # Key and value gradients accumulate transposed, [b, hkv, Dh, keys], carried from group to
    # group (no pad-and-add per group). XLA's CPU backend runs the key-gradient product outside
    # its fast kernels either way (a transposed operand), but faster as q^T ds than as ds^T q:
    # 82 -> 55 ms of such products in the profile of an 8 x 512 train step, 2-core CPU.
    qs, kt, vt, segment_ids, o, lse = residuals
    n, b, hkv, g, blk, dh = qs.shape
    t = d_out.shape[1]
    dos = _to_blocks(d_out, hkv, blk)
    dqs = []
    dk = dv = jnp.zeros((b, hkv, dh, n * blk), jnp.float32)
    for a, e in _groups(n):
        keys = e * blk
        kk, vv, sk = _group_keys(kt, vt, segment_ids, keys)

        def body(carry, x, kk=kk, vv=vv, sk=sk):
            dkt, dvt = carry
            qb, start, ob, dob, lb = x
            sq = jax.lax.dynamic_slice_in_dim(segment_ids, start, blk, axis=1)
            p, _ = _block_probs(qb, sq, start, kk, sk, lse=lb)
            do = dob.reshape(b, hkv, g * blk, dh)
            dvt = dvt + _dot(jnp.swapaxes(do, 2, 3), p.astype(do.dtype), 3, 2)
            dp = _dot(do, vv, 3, 3)
            delta = jnp.sum(do.astype(jnp.float32) * ob.reshape(do.shape).astype(jnp.float32), -1)
            ds = (p * (dp - delta[..., None]) * (dh**-0.5)).astype(kk.dtype)
            dkt = dkt + _dot(jnp.swapaxes(qb.reshape(do.shape), 2, 3), ds, 3, 2)
            return (dkt, dvt), _dot(ds, kk, 3, 2).reshape(qb.shape).astype(qb.dtype)

        xs = (qs[a:e], jnp.arange(a, e) * blk, o[a:e], dos[a:e], lse[a:e])
        (dk_g, dv_g), dq = jax.lax.scan(body, (dk[..., :keys], dv[..., :keys]), xs)
        dk, dv = dk.at[..., :keys].set(dk_g), dv.at[..., :keys].set(dv_g)
        dqs.append(dq)
    dk, dv = (jnp.transpose(x, (0, 3, 1, 2))[:, :t].astype(kt.dtype) for x in (dk, dv))
    seg_zero = np.zeros((b, t), jax.dtypes.float0)
    return _from_blocks(jnp.concatenate(dqs), t), dk, dv, seg_zero


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _packed(q, k, v, segment_ids, block):
    # Without a gradient (prefill, log-probs), rows go through in chunks on a lone CPU device:
    # all rows at once, a block's scores and probabilities outgrow the CPU's caches (2-core
    # CPU, 12 rows x 512 tokens: 49-51 ms for all rows at once, 24-26 ms in chunks of 4). Under a
    # gradient the forward keeps all rows together: chunked there, the backward did not gain
    # and long rows lost. Accelerators have no such caches to fit, and under a mesh a loop
    # over row chunks would slice across the devices that hold the rows.
    rows = q.shape[0]
    chunk = _rows_per_chunk(rows, q.shape[2] * block * q.shape[1] * 4) if _one_cpu() else rows
    if chunk == rows:
        return _packed_forward(q, k, v, segment_ids, block)[0]
    split = lambda x: x.reshape(rows // chunk, chunk, *x.shape[1:])
    out = jax.lax.map(lambda xs: _packed_forward(*xs, block)[0],
                      tuple(split(x) for x in (q, k, v, segment_ids)))
    return out.reshape(q.shape)


def _one_cpu() -> bool:
    """Whether this process computes on a single CPU device (where row chunks pay)."""
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def _rows_per_chunk(rows: int, row_bytes: int) -> int:
    """Rows attended together without a gradient: the largest proper divisor of ``rows`` of at
    least 2 whose fp32 block scores (``row_bytes`` a row) fit in ``_CHUNK_BYTES``; else all
    rows (one row at a time was slower than all at once, measured at 2 x 2048 tokens)."""
    fits = [c for c in range(2, rows) if rows % c == 0 and c * row_bytes <= _CHUNK_BYTES]
    return max(fits, default=rows)


_packed.defvjp(_packed_forward, _packed_backward)


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    block: int = _BLOCK,
) -> jax.Array:
    """Causal attention inside the segments of packed rows.

    q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh], segment_ids [B, T] (0 = padding) -> [B, T, Hq, Dh];
    padding rows give zeros. Query i sees key j iff j <= i and both carry the same non-zero
    segment id. ``block``: query rows per block (at most T).
    """
    return _packed(q, k, v, segment_ids, min(block, q.shape[1]))


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
