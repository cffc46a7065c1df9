"""One decoder-only transformer definition (Qwen2, Qwen3, Llama 3) and its Hugging Face I/O."""

from areal_jax.models.build import abstract_model, init_model
from areal_jax.models.config import ModelConfig, ModelConfigError
from areal_jax.models.hf_export import export_dtype, export_hf, export_hf_tensors, hf_state_dict
from areal_jax.models.hf_io import CheckpointError, load_hf_model
from areal_jax.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from areal_jax.models.transformer import KVCache, Transformer

__all__ = [
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "TinyModelSpec",
    "Transformer",
    "abstract_model",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "export_dtype",
    "export_hf",
    "export_hf_tensors",
    "hf_state_dict",
    "init_model",
    "load_hf_model",
]
