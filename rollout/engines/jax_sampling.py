"""On-device token sampling with per-slot parameters: greedy, temperature, top-k, top-p.

Every row of a batch (one decode slot) carries its own temperature, top-k, top-p and random
key, so requests with different sampling parameters share one batch and one compiled program.

Conventions:
- The reported log-prob of a sampled token is ``log_softmax(logits / temperature)`` over the
  full vocabulary, taken before top-k/top-p filtering; greedy rows (temperature below
  ``areal_jax.protocol.GREEDY_TEMPERATURE``, 0 included) report ``log_softmax(logits)``. The
  trainer recomputes exactly this.
- Top-k is applied first, then top-p on the top-k distribution renormalised (as vLLM does;
  SGLang measures the top-p mass over the whole distribution, so with both set it may keep
  more tokens). Tokens tied with the last kept one are kept too.
- The random key of a token depends only on the request's seed and the token's position in
  the sequence, so a seeded request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.protocol import GREEDY_TEMPERATURE

_MASKED = -jnp.inf


def seed_words(seed: int) -> tuple[int, int]:
    """A request seed (any int >= 0) as two uint32 words (high, low) of its low 64 bits."""
    seed &= (1 << 64) - 1
    return seed >> 32, seed & 0xFFFFFFFF


def token_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Random keys [B] for the tokens at ``positions`` [B] of requests seeded ``seeds`` [B, 2]."""

    def one(words, position):
        key = jax.random.fold_in(jax.random.key(0), words[0])
        key = jax.random.fold_in(key, words[1])
        return jax.random.fold_in(key, position)

    return jax.vmap(one)(seeds, positions)


def _float_order(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the float32 values ``x`` are (so floats can be bisected as ints)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _lowest_passing(passes, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the smallest int32 ``t`` in [lo, hi] with ``passes(t)`` [B] true.

    ``passes`` must be monotone in ``t`` and true at ``hi``; 32 halvings cover any int32 range.
    """

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = passes(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / top-p set to -inf.

    scaled [B, V] temperature-scaled logits; top_k [B] int (< 1 or >= V keeps all);
    top_p [B] float in (0, 1]. Returns [B, V]. A token is in the top-k if fewer than k tokens
    have a larger logit; it is in the top-p set if the tokens more likely than it hold less
    than ``top_p`` of the top-k distribution. Both thresholds are found by bisection over the
    float bit patterns (64 passes over the row, no sort).
    """
    vocab = scaled.shape[-1]
    k = jnp.where((top_k >= 1) & (top_k < vocab), top_k, vocab)
    order = _float_order(scaled)
    kth = _lowest_passing(
        lambda t: jnp.sum(order > t[:, None], axis=-1) < k, order.min(-1), order.max(-1)
    )
    in_top_k = order >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, scaled, _MASKED), axis=-1)
    p_order = jax.lax.bitcast_convert_type(probs, jnp.int32)  # probs >= 0: bits are ordered
    cut = _lowest_passing(
        lambda t: jnp.sum(jnp.where(p_order > t[:, None], probs, 0.0), axis=-1) < top_p,
        jnp.zeros_like(kth),
        p_order.max(-1),
    )
    keep = in_top_k & ((top_p >= 1)[:, None] | (p_order >= cut[:, None]))
    return jnp.where(keep, scaled, _MASKED)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and return (tokens [B] int32, log-probs [B] float32).

    logits [B, V] float32; temperature [B] (below ``GREEDY_TEMPERATURE``: greedy); top_k [B]
    int32; top_p [B] float32; seeds [B, 2] and positions [B] give each row's random key (see
    ``token_keys``). See the module docstring for the log-prob convention.
    """
    greedy = temperature < GREEDY_TEMPERATURE
    inv_temp = 1.0 / jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) * inv_temp[:, None]
    vocab = logits.shape[-1]
    filtering = ~greedy & (((top_k >= 1) & (top_k < vocab)) | (top_p < 1))

    def draw():
        candidates = jax.lax.cond(
            jnp.any(filtering), lambda: filter_top_k_top_p(scaled, top_k, top_p), lambda: scaled
        )
        keys = token_keys(seeds, positions)
        return jax.vmap(jax.random.categorical)(keys, candidates).astype(jnp.int32)

    # Keys, filtering and drawing cost several passes over the vocabulary: skipped when no row
    # needs them.
    drawn = jax.lax.cond(jnp.all(greedy), lambda: jnp.zeros_like(temperature, jnp.int32), draw)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
    # log_softmax(scaled) at the tokens only, with the same arithmetic.
    top = jax.lax.stop_gradient(jnp.max(scaled, axis=-1))
    norm = jnp.log(jnp.sum(jnp.exp(scaled - top[:, None]), axis=-1))
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    # A log-probability is <= 0; compiled, rounding can put it above by about
    # max|logit| / temperature x 6e-8, which matters at tiny temperatures.
    return tokens, jnp.minimum((picked - top) - norm, 0.0)
