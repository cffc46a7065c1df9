"""The name table between our (layer-stacked) parameters and Hugging Face tensors.

HF linear weights are [out, in], ours are [in, *out] (o_proj: [*in, out]); biases are flat in
HF and per head in ours. Each entry says which conversion applies.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
from flax import nnx

from areal_jax.models.build import abstract_model
from areal_jax.models.config import ModelConfig

# The float dtypes a checkpoint may hold, with the names they go by (lower case).
DTYPE_ALIASES = {
    np.dtype(np.float32): ("float32", "fp32", "f32"),
    np.dtype(ml_dtypes.bfloat16): ("bfloat16", "bf16"),
    np.dtype(np.float16): ("float16", "fp16", "f16", "half"),
}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and its Hugging Face name (``{i}`` = layer index if stacked)."""

    path: tuple[str, ...]
    hf_name: str
    kind: str  # "copy" | "linear" (HF [out, in]) | "bias"
    in_dims: int = 1  # leading dims of our per-layer shape that form a linear's input

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """The name table for ``cfg`` (bias / qk-norm / lm_head entries only where they exist)."""
    p = "model.layers.{i}."
    maps = [
        TensorMap(("embed",), "model.embed_tokens.weight", "copy"),
        TensorMap(("layers", "attn_norm"), p + "input_layernorm.weight", "copy"),
        TensorMap(("layers", "q_kernel"), p + "self_attn.q_proj.weight", "linear"),
        TensorMap(("layers", "k_kernel"), p + "self_attn.k_proj.weight", "linear"),
        TensorMap(("layers", "v_kernel"), p + "self_attn.v_proj.weight", "linear"),
        TensorMap(("layers", "o_kernel"), p + "self_attn.o_proj.weight", "linear", in_dims=2),
        TensorMap(("layers", "mlp_norm"), p + "post_attention_layernorm.weight", "copy"),
        TensorMap(("layers", "gate_kernel"), p + "mlp.gate_proj.weight", "linear"),
        TensorMap(("layers", "up_kernel"), p + "mlp.up_proj.weight", "linear"),
        TensorMap(("layers", "down_kernel"), p + "mlp.down_proj.weight", "linear"),
        TensorMap(("final_norm",), "model.norm.weight", "copy"),
    ]
    if cfg.qkv_bias:
        maps += [TensorMap(("layers", f"{n}_bias"), p + f"self_attn.{n}_proj.bias", "bias")
                 for n in "qkv"]
    if cfg.o_bias:
        maps.append(TensorMap(("layers", "o_bias"), p + "self_attn.o_proj.bias", "bias"))
    if cfg.qk_norm:
        maps += [TensorMap(("layers", f"{n}_norm"), p + f"self_attn.{n}_norm.weight", "copy")
                 for n in "qk"]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap(("lm_head",), "lm_head.weight", "linear"))
    return maps


def layer_names(m: TensorMap, cfg: ModelConfig) -> list[str]:
    """The HF names of ``m``: one per layer if stacked, else one."""
    return [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name]


def hf_shape(m: TensorMap, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor whose per-layer shape is ``shape`` in our layout."""
    if m.kind == "linear":
        return (math.prod(shape[m.in_dims:]), math.prod(shape[: m.in_dims]))
    if m.kind == "bias":
        return (math.prod(shape),)
    return tuple(shape)


def hf_shapes(cfg: ModelConfig, state=None) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of every tensor of a ``cfg`` model (``state``: its abstract state)."""
    if state is None:
        state = nnx.state(abstract_model(cfg))
    out = {}
    for m in tensor_maps(cfg):
        shape = get_var(state, m.path).get_raw_value().shape
        shape = shape[1:] if m.stacked else shape
        out.update((name, hf_shape(m, shape)) for name in layer_names(m, cfg))
    return out


# One strided copy of a large matrix's transpose is several times slower than copying it in
# blocks of rows that stay in the CPU caches.
_TRANSPOSE_ROWS = 32


def hf_to_ours(m: TensorMap, hf: np.ndarray, shape: tuple[int, ...],
               out: np.ndarray | None = None) -> np.ndarray:
    """Convert one HF tensor (already of shape ``hf_shape(m, shape)``) to our ``shape``,
    into ``out`` when given (our ``shape``, any float dtype); without ``out`` a tensor that
    needs no transpose comes back as a view."""
    if out is None:
        if m.kind != "linear":
            return hf.reshape(shape)
        out = np.empty(shape, hf.dtype)
    flat = out.reshape(hf.shape[::-1] if m.kind == "linear" else hf.shape, copy=False)  # a view
    if m.kind == "linear":  # HF [out, in] -> ours [in, out], a block of source rows at a time
        for start in range(0, hf.shape[0], _TRANSPOSE_ROWS):
            flat[:, start:start + _TRANSPOSE_ROWS] = hf[start:start + _TRANSPOSE_ROWS].T
    else:
        flat[...] = hf
    return out


def get_var(state, path: tuple[str, ...]):
    """The entry of a (nested) NNX state at ``path``."""
    for key in path:
        state = state[key]
    return state
