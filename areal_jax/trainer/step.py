"""Pure train-step functions over one packed micro-batch, and their jitted, sharded forms.

One PPO minibatch update is ``zero_grads`` -> ``ppo_accumulate`` per micro-batch -> ``update``.
Each micro-batch loss is already divided by the minibatch-wide normaliser, so the fp32 sum of
micro-batch gradients is the gradient of the unsplit minibatch, and the single optimiser update
is the same however the minibatch was cut. Batches are dicts of [R, T] arrays
(``PackedBatch.arrays()``) with rows sharded over the "batch" mesh axes; jit keeps one
executable per (R, T) bucket of the packer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.rl import LossConfig, loglinear_proximal_logprobs, policy_loss, token_logprobs

Batch = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything an optimiser update changes: fp32 parameters, AdamW state, update count []."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def logprobs(
    graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *, temperature: float, chunk_size: int
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and the entropy, [R, T] fp32 each, at ``temperature``."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    head = model.head_kernel().astype(hidden.dtype)
    return token_logprobs(hidden, head, batch["targets"], temperature, chunk_size)


def ppo_loss(
    params: nnx.State,
    batch: Batch,
    prox_logp: jax.Array | None,
    normalizer: jax.Array,
    next_version: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    cfg: LossConfig,
    temperature: float,
    chunk_size: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Micro-batch policy loss (already divided by ``normalizer``) and its stats sums.

    ``prox_logp`` [R, T]: recomputed proximal log-probs, or None when the loss needs none or
    ``cfg.prox_logp == "loglinear"`` (then interpolated towards ``next_version``, the version
    this update produces). Adds ``entropy``: the sum over loss tokens.
    """
    logp, entropy = logprobs(graphdef, params, batch, temperature=temperature, chunk_size=chunk_size)
    if cfg.needs_proximal and cfg.prox_logp == "loglinear":
        prox_logp = loglinear_proximal_logprobs(
            logp, batch["behav_logprobs"], batch["versions"], next_version
        )
    loss, stats = policy_loss(
        cfg, logp, prox_logp, batch["behav_logprobs"], batch["advantages"], batch["loss_mask"],
        normalizer, batch["seq_index"],
    )  # fmt: skip
    stats["entropy"] = jnp.sum(batch["loss_mask"] * jax.lax.stop_gradient(entropy))
    return loss, stats


def sft_loss(
    params: nnx.State, batch: Batch, normalizer: jax.Array, *, graphdef: nnx.GraphDef, chunk_size: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy summed over loss-mask tokens / ``normalizer`` (no stats: the loss says it)."""
    logp, _ = logprobs(graphdef, params, batch, temperature=1.0, chunk_size=chunk_size)
    return -jnp.sum(batch["loss_mask"] * logp) / normalizer, {}


def accumulate(loss_fn: Callable, grads: nnx.State, params: nnx.State, *args):
    """``grads + d loss_fn(params, *args) / d params`` with the loss and its stats."""
    (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
    return jax.tree.map(jnp.add, grads, g), loss, stats


def apply_update(
    tx: optax.GradientTransformation, schedule: optax.Schedule, state: TrainState, grads: nnx.State
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser update; metrics: pre-clip global ``grad_norm`` and the ``lr`` it used."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"grad_norm": optax.global_norm(grads), "lr": schedule(state.step)}
    return TrainState(params, opt_state, state.step + 1), metrics


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """The jitted steps of one model on one mesh (argument shapes in the docstrings above).

    logprobs(params, batch) -> logp; ppo_accumulate(grads, params, batch, prox_logp,
    normalizer, next_version) -> (grads, loss, stats); sft_accumulate(grads, params, batch,
    normalizer) -> (grads, loss, stats); zero_grads(params) -> grads; update(state, grads) ->
    (state, metrics). The accumulators donate the gradient sums, the update donates the state.
    """

    logprobs: Callable
    ppo_accumulate: Callable
    sft_accumulate: Callable
    zero_grads: Callable
    update: Callable


def compile_steps(
    graphdef: nnx.GraphDef,
    state_shardings: TrainState,
    mesh: Mesh,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    loss_cfg: LossConfig,
    temperature: float,
    chunk_size: int,
    compiler_options: dict[str, Any] | None = None,
) -> StepFunctions:
    """Jit the step functions with explicit output shardings (gradients shaped like params),
    each compiled with ``compiler_options`` (XLA options, e.g. the backend optimisation
    level)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    replicated = NamedSharding(mesh, PartitionSpec())
    param_sh = state_shardings.params
    ppo = functools.partial(
        ppo_loss, graphdef=graphdef, cfg=loss_cfg, temperature=temperature, chunk_size=chunk_size
    )
    sft = functools.partial(sft_loss, graphdef=graphdef, chunk_size=chunk_size)
    acc_shardings = (param_sh, replicated, replicated)
    return StepFunctions(
        logprobs=jit(
            lambda params, batch: logprobs(
                graphdef, params, batch, temperature=temperature, chunk_size=chunk_size
            )[0]
        ),
        ppo_accumulate=jit(
            functools.partial(accumulate, ppo), out_shardings=acc_shardings, donate_argnums=0
        ),
        sft_accumulate=jit(
            functools.partial(accumulate, sft), out_shardings=acc_shardings, donate_argnums=0
        ),
        zero_grads=jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=param_sh),
        update=jit(
            functools.partial(apply_update, tx, schedule),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ),
    )
