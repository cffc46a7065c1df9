"""Critic-free advantage estimators (registry by name), reward shaping and KL-to-reference terms.

Estimators map the scalar rewards of each prompt group to one advantage per response. The
pipeline ``trajectory_advantages`` turns trajectory groups into per-output-token advantages:
overlong penalty -> reward shaping -> estimator -> KL reward-to-go -> optional batch norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.trajectory import TrajectoryGroup

Estimator = Callable[..., list[np.ndarray]]
_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str) -> Callable[[Estimator], Estimator]:
    """Register ``fn(groups: list[np.ndarray [G_i]], *, eps, std_ddof) -> list[np.ndarray [G_i]]``.

    ``std_ddof`` is the delta degrees of freedom of any group std (1: unbiased, 0: population).
    """

    def wrap(fn: Estimator) -> Estimator:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        return fn

    return wrap


def advantage_estimators() -> tuple[str, ...]:
    """Names of the registered estimators."""
    return tuple(sorted(_ESTIMATORS))


GroupStd = Literal["unbiased", "population"]
_DDOF = {"unbiased": 1, "population": 0}


def compute_advantages(
    name: str,
    rewards_per_group: Sequence[Sequence[float]],
    *,
    eps: float = 1e-6,
    group_std: GroupStd = "unbiased",
) -> list[np.ndarray]:
    """One advantage per response, group by group, with the estimator registered as ``name``.

    ``group_std``: the group std of GRPO is the unbiased one (ddof=1, as in AReaL and TRL) or
    the population one (ddof=0).
    """
    if group_std not in _DDOF:
        raise ValueError(f"group_std must be unbiased or population, got {group_std!r}")
    if name not in _ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {', '.join(advantage_estimators())}"
        )
    groups = [np.asarray(g, dtype=np.float64) for g in rewards_per_group]
    for i, g in enumerate(groups):
        if g.ndim != 1 or g.size == 0:
            raise ValueError(f"rewards_per_group[{i}] must be a non-empty 1-D list, got {g.shape}")
        if not np.all(np.isfinite(g)):
            raise ValueError(f"rewards_per_group[{i}] holds a non-finite reward: {g.tolist()}")
    advantages = _ESTIMATORS[name](groups, eps=eps, std_ddof=_DDOF[group_std])
    return [a.astype(np.float32) for a in advantages]


# Estimators whose baseline is the rest of the prompt's group: a group of one sample gets an
# advantage of 0 from them, so nothing to learn from its reward.
GROUP_RELATIVE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


@register_advantage("grpo")
def _grpo(groups, *, eps, std_ddof):
    """``(r - mean) / (std + eps)`` per group; a group of one (no spread to estimate) gets 0."""
    return [
        (g - g.mean()) / ((g.std(ddof=std_ddof) if g.size > std_ddof else 0.0) + eps)
        for g in groups
    ]


@register_advantage("dr_grpo")
def _dr_grpo(groups, **_):
    """``r - mean`` of the group (no std division)."""
    return [g - g.mean() for g in groups]


@register_advantage("rloo")
def _rloo(groups, **_):
    """``r - mean of the other samples`` of the group; needs groups of at least 2."""
    for i, g in enumerate(groups):
        if g.size < 2:
            raise ValueError(f"rloo needs at least 2 samples per group; group {i} has {g.size}")
    return [g - (g.sum() - g) / (g.size - 1) for g in groups]


@register_advantage("reinforce")
def _reinforce(groups, **_):
    """``r - mean over the whole batch`` (REINFORCE with a batch-mean baseline)."""
    mean = np.concatenate(groups).mean()
    return [g - mean for g in groups]


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Reward shaping and advantage options.

    Overlong penalty: on when ``overlong_window`` W > 0 (needs the generation budget L_max).
    KL to a reference: on when ``kl_beta`` > 0 (needs per-token KL terms).
    ``group_std``: GRPO's group std, unbiased (ddof=1, the AReaL/TRL default) or population.
    """

    estimator: str = "grpo"
    eps: float = 1e-6
    group_std: GroupStd = "unbiased"
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float | None = None
    overlong_window: int = 0
    overlong_factor: float = 1.0
    normalize_batch: bool = False
    kl_beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"

    def __post_init__(self):
        if self.estimator not in _ESTIMATORS:
            raise ValueError(
                f"estimator {self.estimator!r} is not registered; "
                f"choose one of {', '.join(advantage_estimators())}"
            )
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.group_std not in _DDOF:
            raise ValueError(
                f"group_std must be unbiased or population, got {self.group_std!r}"
            )
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ValueError(f"reward_clip must be > 0 or null, got {self.reward_clip}")
        if self.overlong_window < 0:
            raise ValueError(f"overlong_window must be >= 0, got {self.overlong_window}")
        if self.overlong_factor < 0:
            raise ValueError(f"overlong_factor must be >= 0, got {self.overlong_factor}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")


def shape_rewards(
    rewards: np.ndarray, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> np.ndarray:
    """``clip((r + bias) * scale, -clip, clip)``; no clipping when ``clip`` is None. [N] -> [N]."""
    shaped = (np.asarray(rewards, dtype=np.float64) + bias) * scale
    return shaped if clip is None else np.clip(shaped, -clip, clip)


def overlong_penalty(
    lengths: np.ndarray, max_len: int, window: int, factor: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong penalty ``min(-(L - (L_max - W)) / W * f, 0)``. [N] -> [N].

    Zero while ``L <= L_max - W``, falling linearly to ``-f`` at ``L = L_max``.
    """
    if window < 1 or window > max_len:
        raise ValueError(f"overlong window must be in [1, max_len={max_len}], got {window}")
    lengths = np.asarray(lengths, dtype=np.float64)
    return np.minimum(-(lengths - (max_len - window)) / window * factor, 0.0)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k1") -> jax.Array:
    """Per-token KL(policy || reference) estimate from sampled tokens; any shape, float32.

    k1 = lp - lr; k2 = (lp - lr)^2 / 2; k3 = exp(lr - lp) - (lr - lp) - 1 (>= 0).
    """
    d = jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.expm1(-d) + d
    raise ValueError(f"KL estimator must be k1, k2 or k3, got {estimator!r}")


def kl_reward_to_go(kl: np.ndarray, mask: np.ndarray, beta: float) -> np.ndarray:
    """Advantage term from a per-token reward ``-beta * kl_t`` with gamma = lambda = 1. [O] -> [O].

    Token t collects the penalties of itself and every later trained token:
    ``-beta * sum_{s >= t, mask_s} kl_s``.
    """
    per_token = -beta * np.asarray(kl, np.float64) * np.asarray(mask, np.float64)
    return np.cumsum(per_token[::-1])[::-1]


def trajectory_advantages(
    groups: Sequence[TrajectoryGroup],
    cfg: AdvantageConfig,
    *,
    max_new_tokens: int | None = None,
    kl: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Per-output-token advantages [O_i] for every trajectory, groups flattened in order.

    Steps: reward + overlong penalty (L = output length, budget ``max_new_tokens``), shaping
    (``clip((r + bias) * scale)``), the group estimator, the KL folded in as a per-token reward
    (``A_t = A + kl_reward_to_go``, as in AReaL, rather than a separate loss term), and, if
    ``normalize_batch``, ``(A - mean) / (std + eps)`` over all trained tokens of the batch
    (population std). ``kl[i]`` [O_i] is ``kl_penalty`` of trajectory i (flattened order).
    Tokens with output_mask 0 get advantage 0.
    """
    if not groups:
        raise ValueError("trajectory_advantages needs at least one group")
    trajs = [t for g in groups for t in g.trajectories]
    for gi, g in enumerate(groups):
        if not g.trajectories:
            raise ValueError(f"group {gi} ({g.group_id!r}) has no trajectories")
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    if cfg.overlong_window > 0:
        if max_new_tokens is None:
            raise ValueError("overlong_window > 0 needs max_new_tokens (the budget L_max)")
        lengths = np.array([len(t.output_ids) for t in trajs])
        rewards = rewards + overlong_penalty(
            lengths, max_new_tokens, cfg.overlong_window, cfg.overlong_factor
        )
    rewards = shape_rewards(rewards, cfg.reward_bias, cfg.reward_scale, cfg.reward_clip)
    bounds = np.cumsum([0] + [len(g.trajectories) for g in groups])
    per_group = [rewards[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    scalar = np.concatenate(
        compute_advantages(cfg.estimator, per_group, eps=cfg.eps, group_std=cfg.group_std)
    )

    if cfg.kl_beta > 0 and kl is None:
        raise ValueError("kl_beta > 0 needs per-token KL terms (kl=)")
    if kl is not None and len(kl) != len(trajs):
        raise ValueError(f"kl has {len(kl)} entries for {len(trajs)} trajectories")
    out = []
    for i, t in enumerate(trajs):
        adv = np.full(len(t.output_ids), scalar[i], dtype=np.float64)
        if cfg.kl_beta > 0:
            k = np.asarray(kl[i])
            if k.shape != adv.shape:
                raise ValueError(f"kl[{i}] has shape {k.shape}, expected {adv.shape}")
            adv = adv + kl_reward_to_go(k, t.output_mask, cfg.kl_beta)
        out.append(adv)

    if cfg.normalize_batch:
        valid = np.concatenate([a[t.output_mask == 1] for a, t in zip(out, trajs, strict=True)])
        if valid.size:
            mean, std = valid.mean(), valid.std(ddof=0)
            out = [(a - mean) / (std + cfg.eps) for a in out]
    return [
        np.where(t.output_mask == 1, a, 0.0).astype(np.float32)
        for a, t in zip(out, trajs, strict=True)
    ]
