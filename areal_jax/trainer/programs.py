"""The trainer's jitted programs, and how to compile each ahead of need from shapes alone.

``TrainPrograms`` builds the step functions of one model on one mesh and compiles them by key:
``("update",)`` (gradient zeros and the optimiser update), ``("checksums",)`` (the checkpoint
checksums) and ``("train", (rows, tokens))`` (a micro-batch shape's log-prob forward and
accumulation). It needs no parameter values, only their shapes, so the same programs can be
built in another process from a ``ProgramSpec`` (``compile_helper``): compiled there into the
persistent compilation cache, they load in the trainer instead of compiling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import ModelConfig, abstract_model
from areal_jax.parallel import model_shardings
from areal_jax.trainer import batches
from areal_jax.trainer.checkpoint import compile_checksums
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.optimizer import lr_schedule, make_optimizer
from areal_jax.trainer.step import TrainState, compile_steps


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """What the trainer's programs depend on, without its weights (picklable)."""

    config: TrainerConfig
    model_cfg: ModelConfig
    platform: str
    device_ids: tuple[int, ...]  # the mesh's devices, flattened in mesh order
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    @classmethod
    def of(cls, config: TrainerConfig, model_cfg: ModelConfig, mesh: Mesh) -> ProgramSpec:
        """The spec of a trainer with ``config`` and ``model_cfg`` on ``mesh``."""
        devices = list(mesh.devices.flat)
        return cls(config, model_cfg, mesh_platform(mesh), tuple(d.id for d in devices),
                   tuple(mesh.devices.shape), tuple(mesh.axis_names))

    def make_mesh(self) -> Mesh:
        """The same mesh in this process; ValueError if its devices are not here."""
        devices = {d.id: d for d in jax.devices()}
        missing = [i for i in self.device_ids if i not in devices]
        if missing or jax.default_backend() != self.platform:
            raise ValueError(
                f"the trainer's mesh has {self.platform} devices {list(self.device_ids)}; this "
                f"process has {jax.default_backend()} devices {sorted(devices)}")
        grid = np.array([devices[i] for i in self.device_ids]).reshape(self.mesh_shape)
        return Mesh(grid, self.axis_names)

    def programs(self) -> TrainPrograms:
        """The trainer's programs, built from shapes (``abstract_policy``) on ``make_mesh()``."""
        graphdef, shapes = abstract_policy(self.config, self.model_cfg)
        mesh = self.make_mesh()
        params = _with_shardings(shapes, model_shardings(shapes, mesh))
        return TrainPrograms(self.config, graphdef, params, mesh)


def abstract_policy(config: TrainerConfig, model_cfg: ModelConfig) -> tuple[nnx.GraphDef, Any]:
    """(graphdef, parameter shapes) of the policy a trainer with ``config`` builds."""
    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
    return nnx.split(abstract_model(model_cfg, dtype, config.remat, config.scan_layers))


class TrainPrograms:
    """The jitted steps of a trainer and the shapes of their arguments."""

    def __init__(self, config: TrainerConfig, graphdef: nnx.GraphDef, params: Any, mesh: Mesh):
        """``params``: the parameters, or their ShapeDtypeStructs with shardings."""
        self.config = config
        self.mesh = mesh
        self.tx = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shapes = jax.eval_shape(self.tx.init, params)
        opt_shardings = model_shardings(opt_shapes, mesh)
        self.shardings = TrainState(model_shardings(params, mesh), opt_shardings, replicated)
        self.steps = compile_steps(
            graphdef, self.shardings, mesh, self.tx, lr_schedule(config),
            loss_cfg=config.loss, temperature=config.logprob_temperature,
            chunk_size=config.logprob_chunk_size, compiler_options=compiler_options(config, mesh),
        )  # fmt: skip
        self.abstract_params = _with_shardings(params, self.shardings.params)
        self.abstract_state = TrainState(
            self.abstract_params, _with_shardings(opt_shapes, opt_shardings),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
        rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        self.abstract_rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated)

    @property
    def recomputes_proximal(self) -> bool:
        """Whether a step recomputes proximal log-probs with a forward of its own."""
        loss = self.config.loss
        return loss.needs_proximal and loss.prox_logp == "recompute"

    def checkpoint_tree(self, state: TrainState, rng: Any) -> dict:
        """The tree a checkpoint saves: the train state and the key data of the trainer's rng."""
        return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
                "rng": rng}

    def compile(self, key: Hashable) -> None:
        """Compile the programs of ``key`` for arguments of the shapes ``Trainer`` passes."""
        match key:
            case ("update",):
                self.steps.zero_grads.lower(self.abstract_params).compile()
                self.steps.update.lower(self.abstract_state, self.abstract_params).compile()
            case ("checksums",):
                compile_checksums(self.checkpoint_tree(self.abstract_state, self.abstract_rng))
            case ("train", (rows, tokens)):
                self._compile_train((int(rows), int(tokens)))
            case _:
                raise ValueError(f"no programs are known by the key {key!r}")

    def _compile_train(self, shape: tuple[int, int]) -> None:
        """What ``train_on_batch`` runs on a micro-batch of ``shape``, with the very argument
        kinds it passes (a Python float normaliser, a Python int version)."""
        params, batch = self.abstract_params, batches.abstract_batch(shape, self.mesh)
        prox = None
        if self.recomputes_proximal:
            logprobs = self.steps.logprobs.lower(params, batch).compile()
            prox = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=logprobs.output_shardings)
        self.steps.ppo_accumulate.lower(params, params, batch, prox, 1.0, 1).compile()


def mesh_platform(mesh: Mesh) -> str:
    """The platform of ``mesh``'s devices ("cpu", "gpu", "tpu")."""
    return mesh.devices.flat[0].platform


def compiler_options(config: TrainerConfig, mesh: Mesh) -> dict[str, Any] | None:
    """XLA options of the train programs: ``cpu_opt_level`` on a CPU mesh, else none."""
    if config.cpu_opt_level is None or mesh_platform(mesh) != "cpu":
        return None
    return {"xla_backend_optimization_level": config.cpu_opt_level}


def _with_shardings(tree: Any, shardings: Any) -> Any:
    """``tree``'s shapes and dtypes as ShapeDtypeStructs carrying ``shardings`` (a tree of the
    same leaves, e.g. from ``model_shardings``, where variables are shardings themselves)."""
    leaves, treedef = jax.tree.flatten(tree)
    placed = jax.tree.leaves(shardings)
    if len(placed) != len(leaves):
        raise ValueError(f"{len(placed)} shardings for {len(leaves)} arrays")
    return treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                              for x, s in zip(leaves, placed)])
