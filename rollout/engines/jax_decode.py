"""The engine's two device programs: prefill one slot, and run several decode steps for all.

Both are pure jitted functions of (params, KV cache, per-slot arrays) with static shapes, so
requests coming and going never recompile anything: ``prefill`` compiles once per prompt bucket
and ``decode`` once per attention window (the same buckets), since both read only as much of the
cache as the longest sequence needs. The cache is donated to both and updated in place.

Each emitted token comes with a status code: ``RUNNING`` (the sequence goes on), ``STOP`` (a
stop id was sampled), ``LENGTH`` (its last allowed token) or ``IDLE`` (the slot produced
nothing at that step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models import KVCache
from rollout.engines.jax_sampling import sample, token_keys

IDLE, RUNNING, STOP, LENGTH = 0, 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotArrays:
    """Decode state of every slot, one row per slot ([B] unless noted).

    ``tokens`` holds each slot's last sampled token, not yet in the cache; ``positions`` where
    it goes; ``remaining`` how many tokens the slot may still sample.
    """

    tokens: jax.Array  # int32
    positions: jax.Array  # int32
    remaining: jax.Array  # int32
    active: jax.Array  # bool
    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, -1 = all
    top_p: jax.Array  # float32
    seeds: jax.Array  # uint32 [B, 2]


def _status(tokens, remaining, stop_mask):
    """Status [B] of freshly sampled ``tokens`` [B] given ``remaining`` [B] and stop_mask [B, V]."""
    stopped = jnp.take_along_axis(stop_mask, tokens[:, None], axis=-1)[:, 0]
    return jnp.where(stopped, STOP, jnp.where(remaining <= 1, LENGTH, RUNNING)).astype(jnp.int8)


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames=("cache", "stop_mask"))
def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: KVCache,
    stop_mask: jax.Array,
    slot: jax.Array,
    tokens: jax.Array,
    length: jax.Array,
    request: SlotArrays,
    stop_row: jax.Array,
):
    """Write a context into one slot's cache and sample the token after it.

    tokens [1, T] (the context padded to a bucket T <= S); length: real context length; slot:
    which row of the cache [L, B, Hkv, S, Dh] and of stop_mask [B, V] to fill; request: that
    slot's sampling fields with leading dim 1 (``tokens``/``positions``/``active`` unused);
    stop_row [V] bool. Only the first T cache entries of the row are read or written.
    Returns (cache, stop_mask, token [1], logprob [1], status [1]).
    """
    model = nnx.merge(graphdef, params)
    t = tokens.shape[1]
    corner = (0, slot, 0, 0, 0)

    def window(c):  # [L, 1, Hkv, T, Dh]: the slot's first T entries
        return jax.lax.dynamic_slice(c, corner, (c.shape[0], 1, c.shape[2], t, c.shape[4]))

    positions = jnp.arange(t, dtype=jnp.int32)[None]
    segments = (positions < length).astype(jnp.int32)
    hidden, row = model(tokens, segments, positions, KVCache(window(cache.k), window(cache.v)))
    cache = KVCache(
        jax.lax.dynamic_update_slice(cache.k, row.k, corner),
        jax.lax.dynamic_update_slice(cache.v, row.v, corner),
    )
    logits = model.logits(jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=True))
    keys = token_keys(request.seeds, jnp.reshape(length, (1,)))
    token, logprob = sample(logits, request.temperature, request.top_k, request.top_p, keys)
    stop_mask = jax.lax.dynamic_update_index_in_dim(stop_mask, stop_row, slot, axis=0)
    return cache, stop_mask, token, logprob, _status(token, request.remaining, stop_row[None])


@functools.partial(
    jax.jit, static_argnames=("graphdef", "steps", "window"), donate_argnames="cache"
)
def decode(
    graphdef: nnx.GraphDef,
    steps: int,
    window: int,
    params: nnx.State,
    cache: KVCache,
    stop_mask: jax.Array,
    slots: SlotArrays,
):
    """Run ``steps`` decode steps for every active slot; finished slots stop writing.

    Attention reads only the first ``window`` cache entries, so every position this call
    writes must be below it: ``window >= max(active positions) + steps`` (or = S). Returns
    (cache, slots after the last step, tokens [steps, B] int32, logprobs [steps, B] float32,
    status [steps, B] int8). Steps after every slot finished are skipped.
    """
    model = nnx.merge(graphdef, params)
    full = cache
    cache = KVCache(full.k[:, :, :, :window], full.v[:, :, :, :window])

    def step(cache, s: SlotArrays):
        hidden, cache = model(
            s.tokens[:, None], s.active.astype(jnp.int32)[:, None], s.positions[:, None], cache
        )
        logits = model.logits(hidden[:, 0])
        keys = token_keys(s.seeds, s.positions + 1)
        token, logprob = sample(logits, s.temperature, s.top_k, s.top_p, keys)
        status = jnp.where(s.active, _status(token, s.remaining, stop_mask), IDLE)
        s = dataclasses.replace(
            s,
            tokens=jnp.where(s.active, token, s.tokens),
            positions=s.positions + s.active,
            remaining=s.remaining - s.active,
            active=status == RUNNING,
        )
        return cache, s, token, logprob, status.astype(jnp.int8)

    def idle(cache, s: SlotArrays):
        b = s.tokens.shape[0]
        return cache, s, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.float32), jnp.zeros(b, jnp.int8)

    def body(carry, _):
        cache, s = carry
        cache, s, token, logprob, status = jax.lax.cond(jnp.any(s.active), step, idle, cache, s)
        return (cache, s), (token, logprob, status)

    (cache, slots), (tokens, logprobs, status) = jax.lax.scan(body, (cache, slots), length=steps)
    cache = KVCache(
        full.k.at[:, :, :, :window].set(cache.k), full.v.at[:, :, :, :window].set(cache.v)
    )
    return cache, slots, tokens, logprobs, status
