"""Device mesh, logical-to-mesh sharding rules, and several processes as one trainer."""

from areal_jax.parallel.mesh import MeshConfig, make_mesh
from areal_jax.parallel.multihost import (
    all_processes, broadcast_bytes, host_array, initialize_distributed, is_leader,
)  # fmt: skip
from areal_jax.parallel.sharding import (
    DEFAULT_RULES,
    logical_to_spec,
    model_shardings,
    place,
)
from areal_jax.parallel.trainer_group import TrainerGroup

__all__ = [
    "DEFAULT_RULES",
    "MeshConfig",
    "TrainerGroup",
    "all_processes",
    "broadcast_bytes",
    "host_array",
    "initialize_distributed",
    "is_leader",
    "logical_to_spec",
    "make_mesh",
    "model_shardings",
    "place",
]
