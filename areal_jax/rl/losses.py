"""Decoupled PPO policy loss (AReaL eq. 5), standard PPO, and their aggregation.

Per valid token, with u = exp(lc - lp) and the behaviour weight w = exp(lp - lb) (a constant):
``loss_t = -w * min(u * A, clip(u, 1 - eps_low, 1 + eps_high) * A)``. Every function is pure
over [R, T] arrays. Statistics are returned as sums over valid tokens (maxima for ``*_max``)
so micro-batches accumulate exactly; ``summarize_stats`` turns them into per-token means.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

TokenLoss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class _PolicyLoss:
    fn: TokenLoss
    needs_proximal: bool


_POLICY_LOSSES: dict[str, _PolicyLoss] = {}


def register_policy_loss(name: str, *, needs_proximal: bool) -> Callable[[TokenLoss], TokenLoss]:
    """Register ``fn(cfg, logp, prox_logp, behav_logp, advantages, loss_mask)``.

    ``fn`` returns (per-token loss [R, T], zero where masked; stats of sums). ``needs_proximal``
    says whether the trainer must provide proximal log-probs.
    """

    def wrap(fn: TokenLoss) -> TokenLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = _PolicyLoss(fn, needs_proximal)
        return fn

    return wrap


def policy_losses() -> tuple[str, ...]:
    """Names of the registered policy losses."""
    return tuple(sorted(_POLICY_LOSSES))


Aggregation = Literal["token_mean", "seq_mean_token_mean", "token_sum"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options.

    ``behav_weight_cap``: None = no cap; 'mask' drops tokens with w > cap, 'truncate' uses
    min(w, cap). ``dual_clip``: None or c > 1. ``prox_logp``: 'recompute' (forward pass with the
    pre-update parameters) or 'loglinear' (``loglinear_proximal_logprobs``).
    ``token_sum_divisor``: the constant normaliser of the 'token_sum' aggregation. Tokens
    dropped by the cap still count in the normaliser (as in AReaL's implementation).
    """

    policy_loss: str = "decoupled_ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    behav_weight_cap: float | None = 5.0
    behav_cap_mode: Literal["mask", "truncate"] = "mask"
    dual_clip: float | None = None
    aggregation: Aggregation = "token_mean"
    token_sum_divisor: float = 1.0
    prox_logp: Literal["recompute", "loglinear"] = "recompute"

    def __post_init__(self):
        if self.policy_loss not in _POLICY_LOSSES:
            raise ValueError(
                f"policy_loss {self.policy_loss!r} is not registered; "
                f"choose one of {', '.join(policy_losses())}"
            )
        if not 0 < self.eps_clip_low < 1:
            raise ValueError(f"eps_clip_low must be in (0, 1), got {self.eps_clip_low}")
        if self.eps_clip_high <= 0:
            raise ValueError(f"eps_clip_high must be > 0, got {self.eps_clip_high}")
        if self.behav_weight_cap is not None and self.behav_weight_cap < 1:
            raise ValueError(
                f"behav_weight_cap must be >= 1 or null, got {self.behav_weight_cap} "
                f"(a cap below 1 would reject fresh, on-policy tokens)"
            )
        if self.behav_cap_mode not in ("mask", "truncate"):
            raise ValueError(
                f"behav_cap_mode must be mask or truncate, got {self.behav_cap_mode!r}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 or null, got {self.dual_clip}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean", "token_sum"):
            raise ValueError(f"aggregation {self.aggregation!r} is not a known mode")
        if self.token_sum_divisor <= 0:
            raise ValueError(f"token_sum_divisor must be > 0, got {self.token_sum_divisor}")
        if self.prox_logp not in ("recompute", "loglinear"):
            raise ValueError(f"prox_logp must be recompute or loglinear, got {self.prox_logp!r}")
        if self.prox_logp == "loglinear" and not self.needs_proximal:
            raise ValueError(
                f"prox_logp=loglinear needs a decoupled policy loss, not {self.policy_loss!r}"
            )

    @property
    def needs_proximal(self) -> bool:
        """Whether the chosen loss uses proximal log-probs (decoupled objective)."""
        return _POLICY_LOSSES[self.policy_loss].needs_proximal


def _clipped_surrogate(cfg, logp, prox_logp, behav_logp, advantages, loss_mask, decoupled):
    """Per-token (decoupled) PPO loss [R, T] and stats sums; see the module docstring."""
    mask = loss_mask > 0
    m = mask.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    lb = jax.lax.stop_gradient(behav_logp.astype(jnp.float32))
    lp = jax.lax.stop_gradient(prox_logp.astype(jnp.float32)) if decoupled else lb
    log_u = jnp.where(mask, logp.astype(jnp.float32) - lp, 0.0)
    u = jnp.exp(log_u)
    unclipped = -adv * u
    clipped = -adv * jnp.clip(u, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    clip_hit = clipped > unclipped
    loss = jnp.where(clip_hit, clipped, unclipped)
    dual_hit = jnp.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * adv  # = c * |A| where A < 0
        dual_hit = (adv < 0) & (loss > bound)
        loss = jnp.where(dual_hit, bound, loss)

    if decoupled:
        w_raw = jnp.exp(jnp.where(mask, lp - lb, 0.0))
        cap = cfg.behav_weight_cap
        if cap is None:
            w, capped = w_raw, jnp.zeros_like(mask)
        else:
            capped = w_raw > cap
            w = (
                jnp.where(capped, 0.0, w_raw)
                if cfg.behav_cap_mode == "mask"
                else jnp.minimum(w_raw, cap)
            )
        loss = loss * w
    else:
        w_raw = jnp.ones_like(u)
        capped = jnp.zeros_like(mask)

    loss = jnp.where(mask, loss, 0.0)
    stats = {
        "n_tokens": m.sum(),
        "pg_loss": loss.sum(),
        "clip_frac": (m * clip_hit).sum(),
        "dual_clip_frac": (m * dual_hit).sum(),
        # k3 estimate of KL(pi_prox || pi_theta): u - 1 - log u.
        "approx_kl": (m * (jnp.expm1(log_u) - log_u)).sum(),
        "ratio": (m * u).sum(),
        "behav_weight": (m * w_raw).sum(),
        "behav_weight_max": jnp.max(jnp.where(mask, w_raw, 0.0)),
        "capped_frac": (m * capped).sum(),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)


@register_policy_loss("decoupled_ppo", needs_proximal=True)
def decoupled_ppo_token_loss(cfg, logp, prox_logp, behav_logp, advantages, loss_mask):
    """AReaL eq. 5: trust region around pi_prox, behaviour weight pi_prox / pi_behav (capped)."""
    return _clipped_surrogate(cfg, logp, prox_logp, behav_logp, advantages, loss_mask, True)


@register_policy_loss("ppo", needs_proximal=False)
def ppo_token_loss(cfg, logp, prox_logp, behav_logp, advantages, loss_mask):
    """Standard PPO: trust region around pi_behav, no behaviour weight; prox_logp is ignored."""
    return _clipped_surrogate(cfg, logp, None, behav_logp, advantages, loss_mask, False)


def aggregate_loss(
    token_loss: jax.Array,
    loss_mask: jax.Array,
    aggregation: Aggregation,
    normalizer: jax.Array | float,
    seq_index: jax.Array | None = None,
) -> jax.Array:
    """Scalar loss from per-token losses [R, T] (zero where masked).

    'token_mean' and 'token_sum': ``sum(loss) / normalizer``; 'seq_mean_token_mean': each
    token divided by its sequence's valid-token count first (sequences by ``seq_index`` [R, T],
    -1 padding). ``normalizer`` is a minibatch-wide constant (``loss_normalizer``), so the losses
    of a minibatch's micro-batches sum exactly to the minibatch loss.
    """
    if aggregation == "seq_mean_token_mean":
        if seq_index is None:
            raise ValueError("aggregation seq_mean_token_mean needs seq_index")
        idx = jnp.maximum(seq_index, 0).reshape(-1)
        m = (loss_mask > 0).astype(jnp.float32).reshape(-1)
        counts = jax.ops.segment_sum(m, idx, num_segments=idx.size)
        token_loss = token_loss / jnp.maximum(counts[idx], 1.0).reshape(token_loss.shape)
    elif aggregation not in ("token_mean", "token_sum"):
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return token_loss.sum() / normalizer


def loss_normalizer(cfg: LossConfig, n_valid_tokens: int, n_sequences: int) -> float:
    """The minibatch-wide divisor for ``cfg.aggregation``.

    ``n_valid_tokens``: loss-mask tokens in the whole minibatch; ``n_sequences``: its
    trajectories with at least one such token.
    """
    if cfg.aggregation == "token_mean":
        return float(max(n_valid_tokens, 1))
    if cfg.aggregation == "seq_mean_token_mean":
        return float(max(n_sequences, 1))
    return float(cfg.token_sum_divisor)


@functools.partial(jax.jit, static_argnames="cfg")
def policy_loss(
    cfg: LossConfig,
    logp: jax.Array,
    prox_logp: jax.Array | None,
    behav_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    normalizer: jax.Array | float,
    seq_index: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch and its stats; all arrays [R, T], ``logp`` carries the gradient.

    ``prox_logp`` may be None for losses that do not need it (``cfg.needs_proximal``).
    """
    entry = _POLICY_LOSSES[cfg.policy_loss]
    if entry.needs_proximal and prox_logp is None:
        raise ValueError(f"policy loss {cfg.policy_loss!r} needs prox_logp")
    token_loss, stats = entry.fn(cfg, logp, prox_logp, behav_logp, advantages, loss_mask)
    loss = aggregate_loss(token_loss, loss_mask, cfg.aggregation, normalizer, seq_index)
    return loss, stats


def loglinear_proximal_logprobs(
    logp: jax.Array, behav_logp: jax.Array, versions: jax.Array, current_version: int | jax.Array
) -> jax.Array:
    """Approximate proximal log-probs without a forward pass: ``lb + alpha * (lc - lb)``. [R, T].

    ``alpha = clip((v_prox - v_b) / (v_theta - v_b), 0, 1)`` per token, with v_theta =
    ``current_version`` (the version this update produces) and v_prox = v_theta - 1 (the
    parameters before it). alpha = 0 where v_b < 0 (masked) or v_theta <= v_b. No gradient.
    """
    v_b = versions.astype(jnp.float32)
    v_theta = jnp.asarray(current_version, jnp.float32)
    gap = v_theta - v_b
    ok = (versions >= 0) & (gap > 0)
    alpha = jnp.where(ok, (v_theta - 1.0 - v_b) / jnp.where(ok, gap, 1.0), 0.0)
    alpha = jnp.clip(alpha, 0.0, 1.0)
    lb = behav_logp.astype(jnp.float32)
    return jax.lax.stop_gradient(lb + alpha * (logp.astype(jnp.float32) - lb))


def accumulate_stats(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Combine two micro-batches' stats: sums add, ``*_max`` entries take the maximum."""
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def summarize_stats(stats: dict[str, jax.Array]) -> dict[str, float]:
    """Per-valid-token means of the summed stats (maxima and ``n_tokens`` as they are)."""
    n = max(float(stats["n_tokens"]), 1.0)
    return {
        k: float(v) if k.endswith("_max") or k == "n_tokens" else float(v) / n
        for k, v in stats.items()
    }
