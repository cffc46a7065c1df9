"""Host side of a step: trajectories -> minibatches of packed micro-batches -> device arrays."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.parallel import DEFAULT_RULES, logical_to_spec
from areal_jax.rl import (
    MicroBatchConfig,
    PackedBatch,
    micro_batch_layouts,
    pack_micro_batches,
    split_minibatches,
)
from areal_jax.trajectory import Trajectory, TrajectoryGroup


def flatten_groups(groups: Sequence[TrajectoryGroup]) -> list[Trajectory]:
    """All trajectories of ``groups`` in order; rejects an empty batch or a batch with no
    trained token (every output_mask 0), which would give an update from weight decay alone."""
    if not groups:
        raise ValueError("groups is empty: a training batch needs at least one trajectory group")
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise TypeError(f"groups[{i}] is a {type(g).__name__}, expected a TrajectoryGroup")
    trajs = [t for g in groups for t in g.trajectories]
    if not any(t.output_mask.any() for t in trajs):
        raise ValueError("groups hold no trained token: every trajectory's output_mask is 0")
    return trajs


def batch_axis_size(mesh: Mesh, rules=None) -> int:
    """Devices the row axis of a batch is split over (the mesh axes of logical "batch")."""
    axes = (rules or DEFAULT_RULES)["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def check_split(trajs: Sequence[Trajectory], n_minibatches: int) -> None:
    """Reject a batch that cannot be split into ``n_minibatches`` minibatches."""
    if len({id(t) for t in trajs}) != len(trajs):
        raise ValueError("the same Trajectory object appears twice in the batch")
    if n_minibatches > len(trajs):
        raise ValueError(
            f"ppo_n_minibatches={n_minibatches} is more than the {len(trajs)} trajectories "
            f"of the batch"
        )


def minibatch_plan(
    trajs: Sequence[Trajectory],
    advantages: Sequence[np.ndarray],
    n_minibatches: int,
    cfg: MicroBatchConfig,
    order: np.ndarray,
    known: Collection[tuple[int, int]] = (),
    split: bool = False,
) -> list[list[PackedBatch]]:
    """Split ``trajs`` into minibatches balanced by tokens and pack each into micro-batches
    (preferring the ``known`` shapes and those of earlier minibatches, with ``split`` in parts
    too, see ``pack_micro_batches``).

    ``order`` [N] is a permutation of the trajectories; it decides ties of the balanced split,
    so equal-sized samples land in different minibatches from step to step. Each PackedBatch's
    ``traj_index`` indexes ``trajs``.
    """
    check_split(trajs, n_minibatches)
    position = {id(t): i for i, t in enumerate(trajs)}
    plan, known = [], set(known)
    for members in split_minibatches([trajs[i] for i in order], n_minibatches):
        index = np.array([position[id(t)] for t in members], dtype=np.int32)
        packed = pack_micro_batches(members, [advantages[i] for i in index], cfg, known, split)
        for batch in packed:
            batch.traj_index = index[batch.traj_index]
            known.add(batch.shape)  # later minibatches may share its programs
        plan.append(packed)
    return plan


def minibatch_shapes(
    lengths: Sequence[int],
    n_minibatches: int,
    cfg: MicroBatchConfig,
    order: np.ndarray,
    known: Collection[tuple[int, int]] = (),
    split: bool = False,
) -> list[tuple[int, int]]:
    """The micro-batch shapes (R, T), in order, that ``minibatch_plan`` gives trajectories of
    ``lengths`` tokens (prompt + response) under ``order``, without packing any array; without
    ``split``, the shapes worth compiling for them (not parts of known shapes taken meanwhile:
    ``micro_batch_layouts``)."""
    shapes, known = [], set(known)
    for members in split_minibatches([int(lengths[i]) for i in order], n_minibatches):
        for _, shape, _ in micro_batch_layouts(members, cfg, known, split):
            shapes.append(shape)
            known.add(shape)
    return shapes


def pack_all(
    trajs: Sequence[Trajectory], cfg: MicroBatchConfig, known: Collection[tuple[int, int]] = ()
) -> list[PackedBatch]:
    """Micro-batches of ``trajs`` with zero advantages (for forward passes only), preferring
    the ``known`` shapes.

    Always packed dynamically: the fixed-count mode is a baseline for training updates, and a
    whole batch in a minibatch's count of micro-batches could exceed the token budget.
    """
    dynamic = dataclasses.replace(cfg, mode="dynamic")
    return pack_micro_batches(list(trajs), [0.0] * len(trajs), dynamic, known)


def batch_sharding(shape: tuple[int, int], mesh: Mesh, rules=None) -> NamedSharding:
    """Sharding of an [R, T] batch array: rows split over the "batch" mesh axes."""
    rows = logical_to_spec(("batch",), shape[:1], mesh, rules)
    return NamedSharding(mesh, PartitionSpec(*rows, None))


def put_batch(batch: PackedBatch, mesh: Mesh, rules=None) -> dict[str, jax.Array]:
    """The [R, T] arrays of ``batch`` on ``mesh``, rows split over the "batch" axes.

    Every process holds the whole batch and fills only its own devices' rows (no exchange).
    """
    sharding = batch_sharding(batch.shape, mesh, rules)
    return {k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__)
            for k, v in batch.arrays().items()}  # fmt: skip


def abstract_batch(
    shape: tuple[int, int], mesh: Mesh, rules=None
) -> dict[str, jax.ShapeDtypeStruct]:
    """What ``put_batch`` gives for a batch of ``shape``, as shapes only (to compile ahead)."""
    sharding = batch_sharding(shape, mesh, rules)
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for name, (dtype, _) in PackedBatch.ROW_FIELDS.items()}  # fmt: skip
