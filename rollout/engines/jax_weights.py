"""Load a Hugging Face checkpoint as the engine's parameters, checking it fits the served model.

Runs off the serving path (in its own thread): reading, converting and moving the weights to
the device all happen here, so the swap itself is only an exchange of references between two
device calls. Every failure is a ``WeightLoadError`` that says what was wrong.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from areal_jax.models import ModelConfig, load_hf_model
from rollout.engine import WeightLoadError

# Fields that do not change the computation; a checkpoint may differ from the served one here.
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def architecture_mismatch(served: ModelConfig, new: ModelConfig) -> str | None:
    """The first architecture field where ``new`` differs from ``served``, described; or None."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in _TOKEN_ID_FIELDS:
            continue
        a, b = getattr(served, field.name), getattr(new, field.name)
        if a != b:
            return f"{field.name} is {b!r}, the served model has {a!r}"
    return None


def read_config(path: str) -> ModelConfig:
    """The checkpoint's architecture; ``WeightLoadError`` if it is missing or unsupported."""
    try:
        return ModelConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # ModelConfigError is a ValueError
        raise WeightLoadError(f"checkpoint {path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever a file makes the reader trip on is a
        # failed load, not a crash of the update
        raise WeightLoadError(f"checkpoint {path}: {type(e).__name__}: {e!s:.300}") from e


def load_params(
    path: str, cfg: ModelConfig, dtype, served: ModelConfig | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Read the checkpoint at ``path`` as ``cfg``; params are cast to ``dtype`` and on device.

    With ``served`` given, the checkpoint's own config must describe the same architecture.
    """
    if served is not None:
        mismatch = architecture_mismatch(served, read_config(path))
        if mismatch is not None:
            raise WeightLoadError(f"checkpoint {path} does not fit the served model: {mismatch}")
    try:
        model, _ = load_hf_model(path, dtype=dtype, cfg=cfg, param_dtype=dtype)
    except (OSError, ValueError) as e:  # CheckpointError and SafetensorsError among them
        raise WeightLoadError(f"checkpoint {path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever a file makes the loader trip on, the
        # caller must get a WeightLoadError (the old weights keep serving), not a crash
        raise WeightLoadError(f"checkpoint {path}: {type(e).__name__}: {e!s:.300}") from e
    graphdef, params = nnx.split(model)
    return graphdef, jax.block_until_ready(params)
