"""On-device token sampling with per-slot parameters: greedy, temperature, top-k, top-p.

Every row of a batch (one decode slot) carries its own temperature, top-k, top-p and random
key, so requests with different sampling parameters share one batch and one compiled program.

Conventions:
- The reported log-prob of a sampled token is ``log_softmax(logits / temperature)`` over the
  full vocabulary, taken before top-k/top-p filtering; greedy rows (temperature 0) report
  ``log_softmax(logits)``. The trainer recomputes exactly this.
- Top-k is applied first, then top-p on the top-k distribution renormalised (as SGLang and
  vLLM do). Tokens tied with the last kept logit are kept too.
- The random key of a token depends only on the request's seed and the token's position in
  the sequence, so a seeded request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -jnp.inf


def seed_words(seed: int) -> tuple[int, int]:
    """A request seed (any int >= 0) as two uint32 words (high, low) of its low 64 bits."""
    seed &= (1 << 64) - 1
    return seed >> 32, seed & 0xFFFFFFFF


def token_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Random keys [B] for the tokens at ``positions`` [B] of requests seeded by ``seeds`` [B, 2]."""

    def one(words, position):
        key = jax.random.fold_in(jax.random.key(0), words[0])
        key = jax.random.fold_in(key, words[1])
        return jax.random.fold_in(key, position)

    return jax.vmap(one)(seeds, positions)


def filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / top-p set to -inf.

    scaled [B, V] temperature-scaled logits; top_k [B] int (< 1 or >= V keeps all);
    top_p [B] float in (0, 1]. Returns [B, V].
    """
    vocab = scaled.shape[-1]
    ranks = jnp.arange(vocab)
    k = jnp.where((top_k >= 1) & (top_k < vocab), top_k, vocab)
    descending = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
    in_top_k = ranks[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, descending, _MASKED), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < top_p[:, None])  # a prefix of the ranks; rank 0 always
    last_kept = jnp.sum(keep, axis=-1) - 1
    threshold = jnp.take_along_axis(descending, last_kept[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, _MASKED)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and return (tokens [B] int32, log-probs [B] float32).

    logits [B, V] float32; temperature [B] (0 = greedy); top_k [B] int32; top_p [B] float32;
    keys [B] random keys. See the module docstring for the log-prob convention.
    """
    greedy = temperature <= 0
    inv_temp = 1.0 / jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) * inv_temp[:, None]
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    vocab = logits.shape[-1]
    filtering = ~greedy & (((top_k >= 1) & (top_k < vocab)) | (top_p < 1))
    candidates = jax.lax.cond(
        jnp.any(filtering),
        lambda: filter_top_k_top_p(scaled, top_k, top_p),
        lambda: scaled,
    )
    drawn = jax.vmap(jax.random.categorical)(keys, candidates)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    logprobs = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
