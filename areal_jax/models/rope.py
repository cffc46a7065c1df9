"""Rotary position embeddings (Hugging Face ``rotate_half`` convention) with ``linear``,
``llama3`` or ``yarn`` frequency scaling, computed as transformers computes them."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[np.ndarray, float]:
    """Per-pair rotation frequencies, float32 [head_dim // 2], and the factor cos/sin are
    multiplied by (1 except for yarn)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq, 1.0
    p = dict(scaling.params)
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(p["factor"])).astype(np.float32), 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    return _yarn(head_dim, theta, p)


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    old_len, factor = p["original_max_position_embeddings"], p["factor"]
    low_wavelen = old_len / p["low_freq_factor"]
    high_wavelen = old_len / p["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, p: dict) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp in between (Peng et al. 2023)."""
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = _mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"])
        else:
            attention = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq.astype(np.float32), float(attention)


def apply_rope(
    x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0
) -> jnp.ndarray:
    """Rotate ``x`` [B, T, H, Dh] by ``positions`` [B, T]; cos/sin are multiplied by ``scale``.
    Computed in fp32, returned in x.dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
