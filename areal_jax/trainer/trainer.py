"""The trainer: decoupled-PPO and SFT updates on a sharded model, checkpoints, HF exports.

``train_on_batch`` runs one training step of the AReaL loop: advantages -> minibatch split ->
packing -> proximal log-probs with the current parameters -> one accumulated optimiser update
per minibatch -> version + 1. Parameters and optimiser state stay on the mesh between calls;
only packed int/float arrays go in and scalar metrics come out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.config import ConfigError
from areal_jax.models import (
    ModelConfig, Transformer, hf_state_dict, load_hf_model,
)  # fmt: skip
from areal_jax.parallel import make_mesh, model_shardings, place
from areal_jax.parallel.multihost import host_array, is_leader
from areal_jax.rl import (
    PackedBatch,
    kl_penalty,
    loss_normalizer,
    neighbour_shapes,
    trajectory_advantages,
    unpack_outputs,
)
from areal_jax.trainer import batches
from areal_jax.trainer.ahead import AheadCompiler
from areal_jax.trainer.checkpoint import Checkpointer, abstract_like
from areal_jax.trainer.compile_helper import shared_helper
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.forecast import ShapeForecast
from areal_jax.trainer.programs import (
    ProgramSpec, TrainPrograms, abstract_policy, mesh_platform,
)  # fmt: skip
from areal_jax.trainer.publish import publish_tensors
from areal_jax.trainer.stats import batch_metrics, loss_metrics
from areal_jax.trainer.step import TrainState
from areal_jax.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PublishSnapshot:
    """One version's parameters on the host in HF names and the export dtype.

    ``tensors`` is None on processes other than 0: they took part in the gather only.
    """

    version: int
    tensors: dict[str, np.ndarray] | None
    model_cfg: ModelConfig
    exports_dir: Path
    keep: int
    keep_every: int
    tokenizer_dir: str | None
    source_dir: str | None  # the model directory the parameters were loaded from

    @property
    def kept(self) -> bool:
        """Whether the export outlives pruning (a multiple of ``keep_every``): it is written
        even when a newer version supersedes it before it is delivered."""
        return self.keep_every > 0 and self.version % self.keep_every == 0

    def write(self) -> Path:
        """Write ``<exports_dir>/v{version:06d}`` and prune old versions; host work only, so it
        may run on a background thread while the next step trains."""
        if self.tensors is None:
            raise RuntimeError("only process 0 holds the snapshot's tensors and writes exports")
        return publish_tensors(
            self.tensors, self.model_cfg, self.exports_dir, self.version,
            keep=self.keep, keep_every=self.keep_every, tokenizer_dir=self.tokenizer_dir,
            source_dir=self.source_dir,
        )  # fmt: skip


class Trainer:
    """Owns the policy's parameters and optimiser state on a device mesh.

    Built from ``config.model_path`` (a Hugging Face directory) or from ``model``; the trainer
    takes its own copy of the parameters. ``mesh`` defaults to ``make_mesh(config.mesh)``.
    """

    def __init__(
        self, config: TrainerConfig, mesh: Mesh | None = None, model: Transformer | None = None
    ):
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(config.mesh)
        graphdef, params, self._source_dtypes = self._load_policy(model)
        self._graphdef = graphdef
        self._programs = TrainPrograms(config, graphdef, params, self.mesh)
        self._shardings = shardings = self._programs.shardings
        opt_state = jax.jit(self._programs.tx.init, out_shardings=shardings.opt_state)(params)
        self._state = TrainState(params, opt_state, place(np.int32(0), shardings.step))
        self._steps = self._programs.steps
        self._ref_params = self._load_reference() if config.uses_reference else None
        multiple = math.lcm(config.micro_batch.row_multiple, batches.batch_axis_size(self.mesh))
        model_cfg = self.model.cfg
        break_even = config.micro_batch.attention_break_even or model_cfg.attention_break_even
        self._mb_cfg = dataclasses.replace(
            config.micro_batch, row_multiple=multiple, attention_break_even=break_even
        )
        self._rng = jax.random.key(config.seed)
        self._version = 0
        # (R, T) shapes met, hence compiled: by the train step (log-prob forward and
        # accumulation), and by log-prob forwards alone. Packing prefers them, and in a
        # single-process trainer the shapes compiled ahead as well (``_packing_shapes``);
        # across processes those do not steer packing, so every process packs alike however
        # far its background compiles got.
        self._train_shapes: set[tuple[int, int]] = set()
        self._forward_shapes: set[tuple[int, int]] = set()
        self._sft_shapes: set[tuple[int, int]] = set()  # met by SFT steps (programs of their own)
        self._ahead = self._ahead_compiler() if config.compile_ahead else None
        self._forecast = (ShapeForecast(config.ppo_n_minibatches, self._mb_cfg, seed=config.seed)
                          if self._ahead is not None else None)
        self._checkpoints = (
            Checkpointer(Path(config.run_dir) / "checkpoints", config.checkpoint_keep,
                         config.checkpoint_async, meta_problem=_checkpoint_meta_problem)
            if config.run_dir else None
        )  # fmt: skip
        self._queue_batch_independent_programs()

    @property
    def version(self) -> int:
        """Completed updates (``train_on_batch`` / ``sft_on_batch`` calls) of the policy."""
        return self._version

    @property
    def model(self) -> Transformer:
        """A view of the current parameters; the next update replaces (donates) its arrays."""
        return nnx.merge(self._graphdef, self._state.params)

    def train_on_batch(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """One decoupled-PPO training step on ``groups``; returns the step's metrics."""
        start = time.perf_counter()
        cfg = self.config
        trajs = batches.flatten_groups(groups)
        kl, metrics = None, {}
        if cfg.uses_reference:
            kl = self._reference_kl(trajs)
            metrics["kl_ref/mean"] = _masked_mean(kl, trajs)
        advantages = trajectory_advantages(
            groups, cfg.advantage, max_new_tokens=cfg.max_new_tokens, kl=kl
        )
        metrics.update(batch_metrics(trajs, advantages, self._version))
        rng, key = jax.random.split(self._rng)
        order = np.asarray(jax.random.permutation(key, len(trajs)))
        batches.check_split(trajs, cfg.ppo_n_minibatches)  # before any planning names it
        known = self._packing_shapes()
        wanted = self._wanted_shapes(trajs, order, known)
        plan = batches.minibatch_plan(trajs, advantages, cfg.ppo_n_minibatches, self._mb_cfg,
                                      order, known, split=self._may_split(wanted))
        self._queue_first(wanted)  # compiling while this step runs, where jobs start at once
        self._rng = rng  # the batch is valid: from here on the step goes through
        shapes = {b.shape for mb in plan for b in mb}
        metrics["packing/new_shapes"] = float(self._claim_shapes(shapes))
        metrics["packing/micro_batches"] = float(sum(len(mb) for mb in plan))
        self._claim_ahead(("update",))
        device = [[batches.put_batch(b, self.mesh) for b in mb] for mb in plan]
        recompute = self._recomputes_proximal
        # Proximal log-probs: every micro-batch under the parameters before this step.
        prox = [[self._steps.logprobs(self._state.params, b) if recompute else None
                 for b in mb] for mb in device]  # fmt: skip
        next_version = self._version + 1
        # A minibatch with no trained token (only inserted or empty outputs) makes no update:
        # with zero gradients AdamW would still move the weights along its momentum, decay them
        # and advance the schedule. The batch as a whole always has trained tokens.
        results = [self._update_minibatch(packed, arrays, mb_prox, next_version)
                   for packed, arrays, mb_prox in zip(plan, device, prox)
                   if sum(b.n_valid_tokens for b in packed) > 0]  # fmt: skip
        losses, stats, updates = zip(*jax.device_get(results))
        self._version = next_version
        self._compile_ahead(shapes, groups, len(trajs), wanted)
        stats = [s for mb in stats for s in mb]
        metrics.update(loss_metrics(stats, [sum(mb) for mb in losses], updates))
        metrics["version"] = float(self._version)
        metrics["throughput/tokens_per_s"] = metrics["tokens"] / (time.perf_counter() - start)
        _check_finite(metrics, self._version)
        return metrics

    def check_batch(self, groups: Sequence[TrajectoryGroup]) -> None:
        """Raise the error ``train_on_batch(groups)`` would raise for bad input (no step runs)."""
        batches.check_split(batches.flatten_groups(groups), self.config.ppo_n_minibatches)

    def check_sft(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Raise the error ``sft_on_batch(examples)`` would raise for bad input."""
        _sft_trajectories(examples, self._version)

    def sft_on_batch(
        self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> dict[str, float]:
        """One supervised update: token-mean cross-entropy of each response given its prompt.

        ``examples``: (prompt_ids, response_ids) pairs, both non-empty. All examples form one
        minibatch (micro-batched by the token budget); the version goes up by one.
        """
        start = time.perf_counter()
        trajs = _sft_trajectories(examples, self._version)
        packed = batches.pack_all(trajs, self._mb_cfg)
        new_shapes = _record_shapes(self._sft_shapes, packed)
        n_tokens = sum(b.n_valid_tokens for b in packed)
        self._claim_ahead(("update",))
        grads = self._steps.zero_grads(self._state.params)
        losses = []
        for b in packed:
            grads, loss, _ = self._steps.sft_accumulate(
                grads, self._state.params, batches.put_batch(b, self.mesh), float(n_tokens)
            )
            losses.append(loss)
        self._state, update = self._steps.update(self._state, grads)
        losses, update = jax.device_get((losses, update))
        self._version += 1
        tokens = sum(t.length for t in trajs)
        metrics = {
            "loss": float(sum(losses)),
            "grad_norm": float(update["grad_norm"]),
            "lr": float(update["lr"]),
            "tokens": float(tokens),
            "sft/loss_tokens": float(n_tokens),
            "packing/new_shapes": float(new_shapes),
            "version": float(self._version),
            "throughput/tokens_per_s": tokens / (time.perf_counter() - start),
        }
        _check_finite(metrics, self._version)
        return metrics

    def compile_ahead_for(self, sketches: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Queue the train programs of batches not yet seen, to compile while the trainer waits
        (e.g. for rollout servers to start and the first batch to fill).

        Each sketch is a plausible batch given as the token counts (prompt + response) of its
        trajectories; it is split and packed as ``train_on_batch`` would, and its micro-batch
        shapes are queued, then the shapes next to them (where lengths a little off the
        sketch's would pack), sketch by sketch: likeliest first. A sketch the packing refuses
        (e.g. over the token budget in ``fixed`` mode) is skipped. Returns the shapes queued
        (none without ``compile_ahead``).
        """
        for i, lengths in enumerate(sketches):
            _check_lengths(f"sketches[{i}]", lengths)
        if self._ahead is None:
            return []
        queued = []
        for i, lengths in enumerate(sketches):
            try:
                shapes = batches.minibatch_shapes(lengths, self.config.ppo_n_minibatches,
                                                  self._mb_cfg, np.arange(len(lengths)),
                                                  self._train_shapes)
            except ValueError as e:  # a guess the packing refuses: nothing to compile for it
                log.info("sketch %d is not compiled ahead: %s", i, e)
                continue
            shapes = list(dict.fromkeys(shapes))
            queued += self._queue_train_shapes(shapes + neighbour_shapes(shapes, self._mb_cfg))
        return queued

    def expect_lengths(self, lengths: Sequence[int], batch_trajectories: int
                       ) -> list[tuple[int, int]]:
        """Compile first the train programs that batches of ``batch_trajectories`` trajectories
        drawn from ``lengths`` would need: token counts (prompt + response) of trajectories like
        those to come, e.g. the held-out evaluation's under the current policy.

        They inform the shape forecast until the first batches have been trained on
        (``forecast.ShapeForecast``). Returns the shapes, most likely first (none without
        ``compile_ahead``).
        """
        _check_lengths("lengths", lengths)
        if batch_trajectories < 1:
            raise ValueError(f"batch_trajectories must be >= 1, got {batch_trajectories}")
        if self._forecast is None:
            return []
        self._forecast.set_prior(lengths)
        return self._queue_forecast(batch_trajectories)

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
        """Log-prob [O_i] of every output token under the current parameters, at the sampling
        temperature, in the order of ``trajectories``."""
        return self._logprobs(list(trajectories), self._state.params)

    def save(self, extra: dict | None = None) -> None:
        """Checkpoint the train state and ``extra`` (JSON-able) as the current version."""
        meta = {"version": self._version, "extra": extra or {}}
        self._claim_ahead(("checksums",))
        self._require_checkpoints().save(self._version, self._checkpoint_tree(), meta)

    def restore(self, version: int | None = None) -> dict | None:
        """Load the latest checkpoint (or ``version``) onto this trainer's mesh.

        Returns the ``extra`` dict it was saved with, or None when there is no checkpoint.
        """
        found = self._require_checkpoints().restore(abstract_like(self._checkpoint_tree()), version)
        if found is None:
            return None
        tree, meta = found
        self._state = TrainState(tree["params"], tree["opt_state"], tree["step"])
        self._rng = jax.random.wrap_key_data(jax.device_get(tree["rng"]))
        self._version = int(meta["version"])
        return meta["extra"]

    def checkpoint_versions(self) -> list[int]:
        """Versions of the checkpoints on disk, ascending."""
        return self._require_checkpoints().steps()

    def latest_checkpoint(self) -> int | None:
        """Version of the newest checkpoint, or None."""
        return self._require_checkpoints().latest_step()

    def snapshot_for_publish(self, version: int | None = None) -> PublishSnapshot:
        """Copy the current parameters to the host in the export dtype, for ``write()`` later.

        ``version`` defaults to, and must equal, the current version. With several processes
        every process takes part in the gather and only process 0 keeps the tensors.
        """
        version = self._version if version is None else version
        if version != self._version:
            raise ValueError(
                f"cannot publish version {version}: the parameters are version {self._version}"
            )
        if self.config.run_dir is None:
            raise ConfigError("run_dir is not set: publishing needs <run_dir>/exports")
        if self.config.export_dtype == "source":
            dtype = self._source_dtypes or "float32"
        else:
            dtype = self.config.export_dtype
        tensors = hf_state_dict(self.model, dtype, keep=is_leader())
        return PublishSnapshot(
            version, tensors if is_leader() else None, self.model.cfg,
            Path(self.config.run_dir) / "exports", self.config.export_keep,
            self.config.export_keep_every,
            self.config.tokenizer_path or self.config.model_path, self.config.model_path,
        )  # fmt: skip

    def publish(self, version: int | None = None) -> Path:
        """Export the current parameters as ``<run_dir>/exports/v{version:06d}`` (HF format):
        ``snapshot_for_publish(version).write()``."""
        return self.snapshot_for_publish(version).write()

    def close(self) -> None:
        """Stop compiling ahead, finish pending checkpoint writes, then wait for the compile
        still running (it cannot be interrupted): a stopping run's checkpoint does not wait
        for a program compiled ahead of need."""
        if self._ahead is not None:
            self._ahead.close(wait=False)
        try:
            if self._checkpoints is not None:
                self._checkpoints.close()
        finally:  # a failed write raised: the compile is waited for all the same
            if self._ahead is not None:
                self._ahead.close()

    def idle(self) -> contextlib.AbstractContextManager:
        """A window in which the caller waits (for a batch, for a command): the programs queued
        to compile ahead compile meanwhile, and at no other time (``compile_ahead``)."""
        return self._ahead.idle() if self._ahead is not None else contextlib.nullcontext()

    @property
    def compiles_ahead_in_helper(self) -> bool:
        """Whether programs compile ahead in the helper process, at the lowest CPU priority
        (``compile_ahead_in``): there a compile takes only CPU time nobody else wants."""
        return self._ahead is not None and self._ahead.in_helper

    def wait_compiled_ahead(self, timeout: float | None = None) -> bool:
        """Compile every program queued to compile ahead now; False on timeout."""
        with self.idle():
            return self._ahead is None or self._ahead.wait_done(timeout)

    # -- internals ---------------------------------------------------------------------------

    @property
    def _recomputes_proximal(self) -> bool:
        """Whether a step recomputes proximal log-probs with a forward of its own."""
        return self._programs.recomputes_proximal

    def _ahead_compiler(self) -> AheadCompiler:
        """Where programs compile ahead (``compile_ahead_in``): a helper process on a
        single-process CPU trainer with the persistent cache (on a CPU backend a compile beside
        the steps slows them), else a thread; on an accelerator ``compile_ahead_threads``
        threads, as soon as jobs are queued."""
        where, cache_dir = self.config.compile_ahead_in, jax.config.jax_compilation_cache_dir
        on_cpu = mesh_platform(self.mesh) == "cpu"
        helper_possible = jax.process_count() == 1 and bool(cache_dir)
        if where == "process" and not helper_possible:
            raise ConfigError(
                "compile_ahead_in: process needs a single-process trainer and the persistent "
                "compilation cache (compilation_cache_dir); use thread or auto")
        helper = None
        if where == "process" or (where == "auto" and on_cpu and helper_possible):
            run_dir = self.config.run_dir
            log_path = Path(run_dir) / "logs" / "compile_helper.log" if run_dir else None
            spec = ProgramSpec.of(self.config, self.model.cfg, self.mesh)
            helper = functools.partial(shared_helper(cache_dir, log_path).compile, spec)
        if on_cpu or helper is not None:
            return AheadCompiler(fit_to_waits=on_cpu, helper=helper)
        return AheadCompiler(fit_to_waits=False, workers=self.config.compile_ahead_threads)

    def _packing_shapes(self) -> set[tuple[int, int]]:
        """The shapes packing may prefer: those met, and in a single-process trainer those
        compiled ahead (a step loads them instead of compiling)."""
        if self._ahead is None or jax.process_count() > 1:
            return set(self._train_shapes)
        ahead = {key[1] for key in self._ahead.compiled() if key[0] == "train"}
        return self._train_shapes | ahead

    def _wanted_shapes(self, trajs: Sequence[Trajectory], order: np.ndarray,
                       known: set[tuple[int, int]]) -> list[tuple[int, int]]:
        """The new shapes (not in ``known``) the batch packs into without taking parts of
        known ones (``packing.split_into_known``): those to compile ahead first. Empty without
        compiling ahead."""
        if self._ahead is None:
            return []
        wanted = batches.minibatch_shapes([t.length for t in trajs], self.config.ppo_n_minibatches,
                                          self._mb_cfg, order, known)  # whole, never in parts
        return [s for s in dict.fromkeys(wanted) if s not in known]

    def _may_split(self, wanted: Sequence[tuple[int, int]]) -> bool:
        """Whether the step may take parts of known shapes in place of the new ``wanted``
        ones: only where those compile ahead and packing then prefers them (a single-process
        trainer; across processes only the shapes met steer packing, so the parts would be
        taken for good), and none of them failed to compile ahead."""
        if self._ahead is None or jax.process_count() > 1:
            return False
        failed = self._ahead.failed()
        return not any(("train", s) in failed for s in wanted)

    def _queue_first(self, shapes: Sequence[tuple[int, int]]) -> None:
        """Queue the train programs of ``shapes`` ahead of everything queued before."""
        if self._ahead is not None and shapes:
            self._queue_train_shapes(shapes)
            self._ahead.prioritise([("train", s) for s in shapes])

    def _claim_shapes(self, shapes: set[tuple[int, int]]) -> int:
        """Record the step's micro-batch shapes, waiting for any still compiling ahead; returns
        how many compile in this step (neither met before nor compiled ahead), each logged."""
        new = 0
        for shape in sorted(shapes - self._train_shapes):
            if self._ahead is None or not self._ahead.claim(("train", shape)):
                log.info("micro-batch shape %s (rows x tokens) is new: its programs compile", shape)
                new += 1
        self._train_shapes.update(shapes)
        return new

    def _claim_ahead(self, key: tuple) -> None:
        """About to run ``key``'s programs: wait if they are compiling ahead rather than redo."""
        if self._ahead is not None:
            self._ahead.claim(key)

    def _queue_batch_independent_programs(self) -> None:
        """Ask for the programs every run needs whatever its batches, so they compile while the
        trainer first waits (for the first batch, or for servers): the gradient zeros and the
        optimiser update of the first step, and the checkpoint checksums of the first save."""
        if self._ahead is None:
            return
        self._submit(("update",))
        if self._checkpoints is not None:
            self._submit(("checksums",))

    def _submit(self, key: tuple) -> bool:
        """Queue ``key``'s programs to compile ahead; returns whether they were queued."""
        return self._ahead.submit(key, functools.partial(self._programs.compile, key))

    def _compile_ahead(self, used: set[tuple[int, int]], groups: Sequence[TrajectoryGroup],
                       n_trajectories: int, wanted: Sequence[tuple[int, int]] = ()) -> None:
        """After a step on ``groups`` that used the shapes ``used`` (in place of the new shapes
        ``wanted``): ask, ahead of everything queued before, first for the train programs of
        ``wanted``, then those the forecast ranks likeliest for batches like those seen so far,
        then the shapes next to ``used``."""
        if self._ahead is None:
            return
        self._forecast.observe([[t.length for t in g.trajectories] for g in groups])
        self._queue_forecast(n_trajectories, then=neighbour_shapes(used, self._mb_cfg),
                             first=wanted)

    def _queue_forecast(self, n_trajectories: int, then: Sequence[tuple[int, int]] = (),
                        first: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
        """Queue ``first``, the forecast's shapes for batches of ``n_trajectories``, then
        ``then``, ahead of the rest in that order; returns the forecast's shapes."""
        ranked = self._forecast.rank(n_trajectories, self._packing_shapes())
        self._queue_first(list(dict.fromkeys([*first, *ranked, *then])))
        if ranked:
            log.info("the forecast ranks shapes %s first", ranked)
        return ranked

    def _queue_train_shapes(self, shapes) -> list[tuple[int, int]]:
        """Submit the train programs of each shape not met yet; returns those newly queued."""
        queued = [s for s in shapes
                  if s not in self._train_shapes and self._submit(("train", s))]
        if queued:
            log.info("queued the programs of shapes %s to compile ahead", queued)
        return queued

    def _update_minibatch(self, packed, arrays, prox, next_version):
        """Accumulate the minibatch's micro-batch gradients, then one optimiser update.

        Returns device values: (micro-batch losses, micro-batch stats, update metrics).
        """
        cfg = self.config.loss
        normalizer = loss_normalizer(
            cfg, sum(b.n_valid_tokens for b in packed), sum(b.n_sequences for b in packed)
        )
        grads = self._steps.zero_grads(self._state.params)
        losses, stats = [], []
        for batch, prox_logp in zip(arrays, prox):
            grads, loss, s = self._steps.ppo_accumulate(
                grads, self._state.params, batch, prox_logp, normalizer, next_version
            )
            losses.append(loss)
            stats.append(s)
        self._state, update = self._steps.update(self._state, grads)
        return losses, stats, update

    def _load_policy(self, model: Transformer | None):
        """(graphdef, params on the mesh, HF source dtypes) from the config or ``model``."""
        cfg = self.config
        dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
        if model is not None and cfg.model_path is not None:
            raise ConfigError("model_path is set and a model was passed: give one of them")
        if model is None:
            if cfg.model_path is None:
                raise ConfigError("model_path is required when no model is passed")
            loaded, source_dtypes = load_hf_model(
                cfg.model_path, self.mesh, dtype=dtype, remat=cfg.remat,
                scan_layers=cfg.scan_layers,
            )
            graphdef, params = nnx.split(loaded)
            return graphdef, params, source_dtypes
        graphdef, abstract = abstract_policy(cfg, model.cfg)
        shardings = model_shardings(abstract, self.mesh)
        params = place(nnx.state(model, nnx.Param), shardings, may_alias=False)
        return graphdef, params, {}

    def _load_reference(self) -> nnx.State:
        """Frozen reference parameters: ``ref_model_path``, else a copy of the initial policy."""
        shardings = self._shardings.params
        if self.config.ref_model_path is None:
            return jax.device_put(self._state.params, shardings, may_alias=False)
        ref, _ = load_hf_model(self.config.ref_model_path, self.mesh, dtype=self.model.dtype)
        if ref.cfg != self.model.cfg:
            raise ConfigError(
                f"ref_model_path {self.config.ref_model_path} has another architecture "
                "than the policy"
            )
        return nnx.state(ref, nnx.Param)

    def _logprobs(self, trajs: list[Trajectory], params: nnx.State) -> list[np.ndarray]:
        packed = batches.pack_all(trajs, self._mb_cfg, self._train_shapes | self._forward_shapes)
        _record_shapes(self._forward_shapes, packed)
        outs = [self._steps.logprobs(params, batches.put_batch(b, self.mesh)) for b in packed]
        result: list[np.ndarray] = [np.empty(0)] * len(trajs)
        for b, logp in zip(packed, [host_array(x) for x in outs]):
            for i, values in zip(b.traj_index, unpack_outputs(logp, b.placements)):
                result[i] = values
        return result

    def _reference_kl(self, trajs: list[Trajectory]) -> list[np.ndarray]:
        """Per-token KL(behaviour || reference) [O_i], estimated on the sampled tokens."""
        ref = self._logprobs(trajs, self._ref_params)
        est = self.config.advantage.kl_estimator
        return [np.asarray(kl_penalty(t.behav_logprobs, r, est)) for t, r in zip(trajs, ref)]

    def _checkpoint_tree(self) -> dict:
        rng = place(jax.random.key_data(self._rng), self._shardings.step)
        return self._programs.checkpoint_tree(self._state, rng)

    def _require_checkpoints(self) -> Checkpointer:
        if self._checkpoints is None:
            raise ConfigError("run_dir is not set: checkpoints live in <run_dir>/checkpoints")
        return self._checkpoints


class TrainingDivergedError(ArithmeticError):
    """A step's loss or gradient norm was not finite."""


def _check_finite(metrics: dict[str, float], version: int) -> None:
    """Raise ``TrainingDivergedError`` when the step that made ``version`` had a non-finite
    loss or gradient norm: its parameters are not published or checkpointed (the caller stops),
    so the run resumes from the last checkpoint."""
    bad = {k: metrics[k] for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])}
    if bad:
        raise TrainingDivergedError(
            f"the step to version {version} gave {', '.join(f'{k} {v}' for k, v in bad.items())}: "
            "training diverged (lower the learning rate, set grad_clip) or its input is bad; "
            "nothing of that step was published or checkpointed")


def _checkpoint_meta_problem(meta: dict, step: int) -> str | None:
    """What is wrong with the meta ``save`` wrote for checkpoint ``step`` (see Checkpointer)."""
    version = meta.get("version")
    if type(version) is not int or version != step:
        return f"names version {version!r}, not the step's {step}"
    if not isinstance(meta.get("extra"), dict):
        return f"has no 'extra' object (got {type(meta.get('extra')).__name__})"
    return None


def _check_lengths(name: str, lengths: Sequence[int]) -> None:
    """Reject token counts of no trajectory, or of one under 2 tokens (a prompt token and a
    response token), naming them ``name``."""
    if len(lengths) == 0 or min(lengths) < 2:
        raise ValueError(f"{name}: every trajectory needs >= 2 tokens (a prompt token and a "
                         f"response token), got {list(lengths)[:8]}")


def _masked_mean(values: list[np.ndarray], trajs: list[Trajectory]) -> float:
    """Mean of per-token ``values`` over output_mask tokens."""
    return float(np.concatenate([v[t.output_mask == 1] for v, t in zip(values, trajs)]).mean())


def _sft_trajectories(examples, version: int) -> list[Trajectory]:
    """SFT examples as trajectories (zero behaviour log-probs: the SFT loss ignores them)."""
    if not examples:
        raise ValueError("examples is empty: an SFT batch needs at least one example")
    trajs = []
    for i, example in enumerate(examples):
        if len(example) != 2:
            raise ValueError(f"examples[{i}] must be a (prompt_ids, response_ids) pair")
        prompt, response = example
        if len(prompt) == 0 or len(response) == 0:
            empty = "prompt" if len(prompt) == 0 else "response"
            raise ValueError(f"examples[{i}] has an empty {empty}")
        n = len(response)
        trajs.append(Trajectory(prompt, response, np.zeros(n, np.float32), np.full(n, version)))
    return trajs


def _record_shapes(known: set[tuple[int, int]], packed: list[PackedBatch]) -> int:
    """Add the shapes of ``packed`` to ``known``; a new one means a compile, which is logged.
    Returns how many were new."""
    new = sorted({b.shape for b in packed} - known)
    for shape in new:
        log.info("micro-batch shape %s (rows x tokens) is new: its programs compile", shape)
    known.update(new)
    return len(new)
