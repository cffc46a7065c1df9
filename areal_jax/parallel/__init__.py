"""Device mesh and logical-to-mesh sharding rules."""

from areal_jax.parallel.mesh import MeshConfig, make_mesh
from areal_jax.parallel.sharding import (
    DEFAULT_RULES,
    logical_to_spec,
    model_shardings,
    shard_model_state,
)

__all__ = [
    "DEFAULT_RULES",
    "MeshConfig",
    "logical_to_spec",
    "make_mesh",
    "model_shardings",
    "shard_model_state",
]
