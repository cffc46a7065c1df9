"""Decoder-only transformer (Qwen2 / Qwen3 / Llama 3) in Flax NNX, used by trainer and engine.

Layer weights are stacked along a leading ``layers`` axis and applied with ``jax.lax.scan``,
so compile time does not grow with depth. ``scan_layers=False`` unrolls that loop in the packed
forward: XLA then runs training steps faster (no stacked per-layer residual buffers to fill),
but compile time grows with depth. Every parameter carries ``logical_axes`` metadata that
``areal_jax.parallel.sharding`` maps to mesh axes.

Three call modes share one layer definition:
- packed training: ``model(tokens, segment_ids, positions)``; attention stays inside segments;
- cached calls: ``model(tokens, segment_ids, positions, cache=KVCache)``; queries attend to
  the cache entries before the call's first position plus the call's own keys (same
  segment), and the new keys/values are then written at ``positions`` of each row's cache in
  one scatter after all layers (the layer scan only reads the cache and never re-stacks it).
  Tokens with segment id 0 are padding and write nothing. ``extend`` returns the new
  keys/values instead of writing them (the engine's packed prefill);
- one-token decode steps, ``decode_step``: per-layer weight and cache buffers in an unrolled
  loop. Inside a layer scan XLA on CPU copies every step's slice of the stacked weights and
  cache before each matmul (about half of a 23M-parameter decode step); separate buffers are
  read in place.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.attention import (
    cached_attention,
    decode_attention,
    packed_attention,
)
from areal_jax.models.config import ModelConfig
from areal_jax.models.dense import dense
from areal_jax.models.rope import apply_rope, inverse_frequencies

RematPolicy = Literal["none", "full", "dots"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys and values, [L, B, Hkv, S, Dh] each; B is the number of decode slots.

    Heads before positions, so attention reads each head's keys contiguously."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, result cast back to x.dtype (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def _param(rngs: nnx.Rngs | None, shape, axes, init: str, std: float = 0.02) -> nnx.Param:
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


class LayerStack(nnx.Module):
    """All decoder layers' weights, stacked on a leading ``layers`` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.attn_norm = _param(rngs, (L, d), ("layers", "norm"), "ones")
        self.q_kernel = _param(rngs, (L, d, hq, dh), ("layers", "embed", "q_heads", "head_dim"), "normal")
        self.k_kernel = _param(rngs, (L, d, hkv, dh), ("layers", "embed", "kv_heads", "head_dim"), "normal")
        self.v_kernel = _param(rngs, (L, d, hkv, dh), ("layers", "embed", "kv_heads", "head_dim"), "normal")
        self.o_kernel = _param(rngs, (L, hq, dh, d), ("layers", "q_heads", "head_dim", "embed"), "normal")
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (L, hq, dh), ("layers", "q_heads", "head_dim"), "zeros")
            self.k_bias = _param(rngs, (L, hkv, dh), ("layers", "kv_heads", "head_dim"), "zeros")
            self.v_bias = _param(rngs, (L, hkv, dh), ("layers", "kv_heads", "head_dim"), "zeros")
        if cfg.o_bias:
            self.o_bias = _param(rngs, (L, d), ("layers", "norm"), "zeros")
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (L, dh), ("layers", "head_dim"), "ones")
            self.k_norm = _param(rngs, (L, dh), ("layers", "head_dim"), "ones")
        self.mlp_norm = _param(rngs, (L, d), ("layers", "norm"), "ones")
        self.gate_kernel = _param(rngs, (L, d, f), ("layers", "embed", "mlp"), "normal")
        self.up_kernel = _param(rngs, (L, d, f), ("layers", "embed", "mlp"), "normal")
        self.down_kernel = _param(rngs, (L, f, d), ("layers", "mlp", "embed"), "normal")

    def weights(self) -> dict[str, jax.Array]:
        """The stacked weight arrays by name (what ``lax.scan`` iterates over)."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


def _write(cache: KVCache, new: KVCache, segment_ids, positions) -> KVCache:
    """The cache with new keys/values [L, B, T, Hkv, Dh] stored at ``positions`` [B, T]."""
    # Padding tokens write to an out-of-range index, which the scatter drops.
    where = jnp.where(segment_ids != 0, positions, cache.k.shape[3])
    rows = jnp.arange(where.shape[0])[:, None]

    def put(c, new):  # indexed as [B, T, L, Hkv, Dh]
        return c.at[:, rows, :, where].set(jnp.moveaxis(new, 0, 2).astype(c.dtype), mode="drop")

    return KVCache(put(cache.k, new.k), put(cache.v, new.v))


class Transformer(nnx.Module):
    """Causal language model; see the module docstring for the two call modes."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        remat: RematPolicy = "none",
        scan_layers: bool = True,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.remat = remat
        self.scan_layers = scan_layers
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "normal")
        self.layers = LayerStack(cfg, rngs)
        self.final_norm = _param(rngs, (cfg.hidden_size,), ("norm",), "ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), "normal")

    def head_kernel(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied)."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits [..., V] from final hidden states [..., D]."""
        w = self.head_kernel().astype(self.dtype)
        return dense(hidden.astype(self.dtype), w, out_dtype=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens/segment_ids/positions [B, T] -> (final-normed hidden [B, T, D], updated cache)."""
        hidden, new = self.extend(tokens, segment_ids, positions, cache)
        return hidden, None if cache is None else _write(cache, new, segment_ids, positions)

    def extend(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """As ``__call__``, but the cache is only read: returns (hidden [B, T, D], the call's
        keys and values [L, B, T, Hkv, Dh]; None without a cache), for callers that store them
        elsewhere."""
        x = self.embed[...].astype(self.dtype)[tokens]
        rope = inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

        def layer(x, w, cache_k=None, cache_v=None):
            if cache_k is None:
                attend = lambda q, k, v: (packed_attention(q, k, v, segment_ids), (k, v))
            else:
                attend = lambda q, k, v: (
                    cached_attention(q, k, v, cache_k, cache_v, segment_ids, positions), (k, v))
            x, (k, v) = self._block(x, w, positions, rope, attend)
            return x, k, v

        if self.remat == "full":
            layer = jax.checkpoint(layer)
        elif self.remat == "dots":  # the projections' outputs (``dense``) and other plain dots
            policies = jax.checkpoint_policies
            layer = jax.checkpoint(layer, policy=policies.save_from_both_policies(
                policies.checkpoint_dots_with_no_batch_dims,
                policies.save_only_these_names("dense")))

        weights = self.layers.weights()
        if cache is None:
            def step(x, w):
                x, _, _ = layer(x, w)
                return x, None

            x, _ = jax.lax.scan(step, x, weights, unroll=not self.scan_layers)
            new = None
        else:
            def step(x, xs):
                w, ck, cv = xs
                x, k, v = layer(x, w, ck, cv)
                return x, (k, v)

            x, new = jax.lax.scan(step, x, (weights, cache.k, cache.v))
            new = KVCache(*new)
        return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps), new

    def decode_step(
        self,
        layers: list[dict[str, jax.Array]],
        tokens: jax.Array,
        positions: jax.Array,
        active: jax.Array,
        caches: list[KVCache],
    ) -> tuple[jax.Array, list[KVCache]]:
        """One token per row through per-layer weights and caches (separate buffers, which XLA
        reads in place; slices of the stacked arrays are copied on every use).

        layers: ``LayerStack.weights()`` split per layer; tokens/positions/active [B]; caches:
        per layer, k [B, Hkv, Dh, S] (transposed) and v [B, Hkv, S, Dh], S > every active
        position. Each layer first writes the active rows' key and value at their position,
        then attends over entries 0..position. Returns (final-normed hidden [B, D], the
        updated caches).
        """
        x = self.embed[...].astype(self.dtype)[tokens[:, None]]
        rope = inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        rows = jnp.arange(tokens.shape[0])
        where = jnp.where(active, positions, caches[0].v.shape[2])  # inactive rows: dropped

        def attend(cache):
            def go(q, k, v):
                ck = cache.k.at[rows, :, :, where].set(k[:, 0].astype(cache.k.dtype), mode="drop")
                cv = cache.v.at[rows, :, where].set(v[:, 0].astype(cache.v.dtype), mode="drop")
                return decode_attention(q, ck, cv, positions), KVCache(ck, cv)

            return go

        out = []
        for w, cache in zip(layers, caches):
            x, cache = self._block(x, w, positions[:, None], rope, attend(cache))
            out.append(cache)
        return rms_norm(x[:, 0], self.final_norm[...], self.cfg.rms_norm_eps), out

    def _block(self, x, w, positions, rope, attend):
        """One decoder layer on x [B, T, D] with weights ``w`` at ``positions`` [B, T];
        ``attend(q, k, v)`` returns (attention [B, T, Hq, Dh], what to return beside x)."""
        cfg, dtype = self.cfg, self.dtype
        inv_freq, rope_scale = rope
        cast = lambda a: a.astype(dtype)
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        q = dense(h, cast(w["q_kernel"]))
        k = dense(h, cast(w["k_kernel"]))
        v = dense(h, cast(w["v_kernel"]))
        if cfg.qkv_bias:
            q, k, v = q + cast(w["q_bias"]), k + cast(w["k_bias"]), v + cast(w["v_bias"])
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq, rope_scale)
        k = apply_rope(k, positions, inv_freq, rope_scale)
        attn, extra = attend(q, k, v)
        out = dense(attn, cast(w["o_kernel"]), n_in=2)
        x = x + (out + cast(w["o_bias"]) if cfg.o_bias else out)
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        gate = dense(h, cast(w["gate_kernel"]))
        up = dense(h, cast(w["up_kernel"]))
        x = x + dense(jax.nn.silu(gate) * up, cast(w["down_kernel"]))
        return x, extra

    def forward_logits(self, tokens, segment_ids, positions) -> jax.Array:
        """Full fp32 logits [B, T, V] of a packed batch (for evaluation and tests)."""
        hidden, _ = self(tokens, segment_ids, positions)
        return self.logits(hidden)
