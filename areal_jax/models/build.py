"""Create a model directly on its shardings (no replicated full copy on one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import RematPolicy, Transformer
from areal_jax.parallel.sharding import model_shardings


def abstract_model(
    cfg: ModelConfig,
    dtype=jnp.float32,
    remat: RematPolicy = "none",
    scan_layers: bool = True,
) -> Transformer:
    """The model with ShapeDtypeStruct leaves: structure and metadata, no memory."""
    return nnx.eval_shape(
        lambda: Transformer(
            cfg, rngs=nnx.Rngs(0), dtype=dtype, remat=remat, scan_layers=scan_layers
        )
    )


def init_model(
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    *,
    seed: int = 0,
    dtype=jnp.float32,
    remat: RematPolicy = "none",
    scan_layers: bool = True,
    rules=None,
) -> Transformer:
    """Randomly initialised fp32 parameters, each created on its own sharding."""
    abstract = abstract_model(cfg, dtype, remat, scan_layers)
    graphdef, abstract_state = nnx.split(abstract)
    out_shardings = model_shardings(abstract_state, mesh, rules) if mesh is not None else None

    @jax.jit(out_shardings=out_shardings)
    def create():
        model = Transformer(
            cfg, rngs=nnx.Rngs(seed), dtype=dtype, remat=remat, scan_layers=scan_layers
        )
        return nnx.state(model)

    return nnx.merge(graphdef, create())
