"""One rules table from logical parameter axes to mesh axes, and helpers that apply it."""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

# Logical axis -> mesh axis (or None = replicated). Batch-like activations use "batch".
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
}


def _axis_size(mesh: Mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[n] for n in names]))


def logical_to_spec(axes, shape, mesh: Mesh, rules=None) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` with logical ``axes``.

    A dimension that the mapped mesh axes do not divide evenly stays replicated (logged),
    and a mesh axis is used at most once per array.
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        axis = rules[name]
        names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        names = tuple(n for n in names if n in mesh.shape and mesh.shape[n] > 1 and n not in used)
        if names and dim % _axis_size(mesh, names):
            log.info("dimension %s=%d not divisible by mesh axes %s: replicated", name, dim, names)
            names = ()
        used.update(names)
        spec.append(None if not names else (names[0] if len(names) == 1 else names))
    return PartitionSpec(*spec)


def model_shardings(abstract_state: nnx.State, mesh: Mesh, rules=None):
    """NamedSharding for every variable of an (abstract) model state, from its logical axes."""

    def one(var):
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
        value = var.get_raw_value() if isinstance(var, nnx.Variable) else var
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree, shardings, may_alias: bool | None = None):
    """``jax.device_put(tree, shardings)``; with several processes, from host copies: an array
    on one local device cannot seed an array over several processes' devices (with one device
    per process the result held a two-device shard that checkpointing could not take)."""
    if jax.process_count() > 1:  # arrays already over several processes' devices stay
        tree = jax.tree.map(lambda x: x if not getattr(x, "is_fully_addressable", True)
                            else jax.device_get(x), tree)
    return jax.device_put(tree, shardings, may_alias=may_alias)
