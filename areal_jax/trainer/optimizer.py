"""AdamW with global-norm clipping and a warmup + constant/cosine learning-rate schedule."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from areal_jax.trainer.config import TrainerConfig


def lr_schedule(cfg: TrainerConfig) -> optax.Schedule:
    """Learning rate of optimiser update ``count`` (0-based).

    Warmup: ``lr * (count + 1) / warmup_steps`` for the first ``warmup_steps`` updates (never 0).
    Then constant ``lr``, or cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total_steps``
    and flat after it.
    """
    cfg.check_cosine_horizon()  # 0, left unset, passes the config's own check
    warmup, total = cfg.warmup_steps, cfg.total_steps

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        scale = jnp.minimum((c + 1.0) / warmup, 1.0) if warmup else jnp.float32(1.0)
        if cfg.lr_schedule == "cosine":
            t = jnp.clip((c - warmup) / (total - warmup), 0.0, 1.0)
            scale *= cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * t))
        return cfg.lr * scale

    return schedule


def decay_mask(params: nnx.State):
    """True for weight matrices (AdamW decays them), False for norm scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(path[-1].key).endswith(("norm", "bias")),
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (if set) then AdamW on ``lr_schedule(cfg)``."""
    adamw = optax.adamw(
        lr_schedule(cfg),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
