"""The engine's two device programs: prefill newly filled slots, and run decode steps for all.

Both are pure jitted functions of (params, KV cache, per-slot arrays) with static shapes, so
requests coming and going never recompile anything: ``prefill`` packs the contexts of any
number of slots into rows and compiles once per layout (a bucket of total length, cut into
rows of one of a few widths), ``decode`` once
per attention window (the same buckets) and batch bucket, reading only as much of the cache as
the longest sequence needs and computing only as many rows as the bucket that holds every
active slot. The cache is donated to both and updated in place.

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
from rollout.engines.jax_sampling import sample

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
    cache: list[KVCache],
    stop_mask: jax.Array,
    state: SlotArrays,
    tokens: jax.Array,
    segments: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    last: jax.Array,
    requests: SlotArrays,
    stop_rows: jax.Array,
):
    """Write several contexts, packed into rows, into their slots' caches; sample the token
    after each and enter those slots into ``state`` (every slot's decode state), so a decode
    call can start from it before the host has read the sampled tokens.

    cache: per layer, k [B, Hkv, Dh, S] (transposed), v [B, Hkv, S, Dh].
    tokens/segments/positions [N, W] (N * W <= S): context i (of at most R = B) is segment
    i + 1, its positions counting from 0; 0 marks padding; a context attends only within its
    segment, so narrow rows (several contexts each) spare the attention across contexts that
    one long row would compute and mask. slots [R]: the slot of context i, B for unused rows
    (they write nothing); last [R]: where context i ends, as an index into the flattened
    [N * W] rows; requests: the contexts' sampling fields [R] (``tokens``/``positions``/
    ``active`` unused); stop_rows [R, V] bool.
    Returns (cache, stop_mask, state, tokens [R], logprobs [R], status [R]).
    """
    model = nnx.merge(graphdef, params)
    _, kv_heads, head_dim, _ = cache[0].k.shape
    empty = jnp.zeros((len(cache), tokens.shape[0], kv_heads, 0, head_dim), cache[0].k.dtype)
    hidden, new = model.extend(tokens, segments, positions, KVCache(empty, empty))
    seg, at = segments.reshape(-1), positions.reshape(-1)  # [N * W]
    row = jnp.where(seg > 0, slots[seg - 1], slots.shape[0])

    def put(c, new, where):  # indexed as [N * W, Hkv, Dh]; padding and unused rows dropped
        return c.at[where].set(new.reshape(-1, *new.shape[2:]).astype(c.dtype), mode="drop")

    keys, values = (row, slice(None), slice(None), at), (row, slice(None), at)
    cache = [KVCache(put(c.k, k, keys), put(c.v, v, values))
             for c, k, v in zip(cache, new.k, new.v)]
    logits = model.logits(hidden.reshape(-1, hidden.shape[-1])[last])
    token, logprob = sample(logits, requests.temperature, requests.top_k, requests.top_p,
                            requests.seeds, at[last] + 1)
    stop_mask = stop_mask.at[slots].set(stop_rows, mode="drop")
    status = _status(token, requests.remaining, stop_rows)
    filled = dataclasses.replace(  # what SlotTable.filled records on the host
        requests, tokens=token, positions=at[last] + 1,
        remaining=requests.remaining - 1, active=status == RUNNING)
    state = jax.tree.map(lambda a, v: a.at[slots].set(v, mode="drop"), state, filled)
    return cache, stop_mask, state, token, logprob, status


@functools.partial(jax.jit, static_argnames="graphdef")
def split_layers(graphdef: nnx.GraphDef, params: nnx.State) -> list[dict[str, jax.Array]]:
    """The model's stacked layer weights as one buffer per layer and weight (what ``decode``
    reads: XLA would copy every slice of the stacked arrays at every step)."""
    weights = nnx.merge(graphdef, params).layers.weights()
    num_layers = next(iter(weights.values())).shape[0]
    return [{k: w[i] for k, w in weights.items()} for i in range(num_layers)]


@functools.partial(
    jax.jit, static_argnames=("graphdef", "steps", "window"), donate_argnames="cache"
)
def decode(
    graphdef: nnx.GraphDef,
    steps: int,
    window: int,
    params: nnx.State,
    layers: list[dict[str, jax.Array]],
    cache: list[KVCache],
    stop_mask: jax.Array,
    slots: SlotArrays,
    rows: jax.Array,
):
    """Run ``steps`` decode steps for every active slot; finished slots stop writing.

    layers: ``split_layers(params)``; cache: as for ``prefill``. Only the slots ``rows`` [N]
    (ascending, distinct, every active slot among them) are computed, so a call costs what N
    rows cost, not all B: their cache rows, state and stop masks are gathered once per call and
    written back at its end (with N = B they are sliced and written back in place instead: a
    gather of the cache window cost a quarter of a long-window call on a CPU). Attention reads
    only the first ``window`` cache entries, so every position this call writes must be below
    it: ``window >= max(active positions) + steps`` (or = S). Returns (cache, slots after the
    last step, tokens [steps, B] int32, logprobs [steps, B] float32, status [steps, B] int8;
    rows not computed are ``IDLE``). Steps after every slot finished are skipped.
    """
    model = nnx.merge(graphdef, params)
    full, every = cache, slots
    # N = B: rows are 0..B-1 (ascending), so a slice picks them without a gather
    picked = slice(None) if rows.shape[0] == full[0].k.shape[0] else rows
    cache = [KVCache(c.k[picked, ..., :window], c.v[picked, :, :window]) for c in full]
    slots = jax.tree.map(lambda a: a[picked], every)
    stop_mask = stop_mask[picked]

    def step(cache, s: SlotArrays):
        hidden, cache = model.decode_step(layers, s.tokens, s.positions, s.active, cache)
        logits = model.logits(hidden)
        token, logprob = sample(logits, s.temperature, s.top_k, s.top_p, s.seeds, s.positions + 1)
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

    (cache, slots), outputs = jax.lax.scan(body, (cache, slots), length=steps)
    cache = [
        KVCache(f.k.at[picked, ..., :window].set(c.k), f.v.at[picked, :, :window].set(c.v))
        for f, c in zip(full, cache)
    ]
    slots = jax.tree.map(lambda a, part: a.at[picked].set(part), every, slots)
    tokens, logprobs, status = (
        jnp.zeros((steps, every.tokens.shape[0]), o.dtype).at[:, picked].set(o) for o in outputs
    )
    return cache, slots, tokens, logprobs, status
