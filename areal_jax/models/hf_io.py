"""Hugging Face checkpoint I/O: load safetensors straight onto a sharded model, export back.

The name table maps each of our (layer-stacked) parameters to its Hugging Face tensor(s) and
says how to reshape: HF linear weights are [out, in], ours are [in, *out] (o_proj: [*in, out]).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.build import abstract_model
from areal_jax.models.config import ModelConfig
from areal_jax.models.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile, save_safetensors
from areal_jax.models.transformer import RematPolicy, Transformer
from areal_jax.parallel.sharding import model_shardings

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
)


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
    if cfg.qk_norm:
        maps += [TensorMap(("layers", f"{n}_norm"), p + f"self_attn.{n}_norm.weight", "copy")
                 for n in "qk"]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap(("lm_head",), "lm_head.weight", "linear"))
    return maps


def hf_to_ours(m: TensorMap, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Convert one HF tensor to our per-layer ``shape``."""
    if m.kind == "linear":
        return hf.T.reshape(shape)
    return hf.reshape(shape)


def ours_to_hf(m: TensorMap, ours: np.ndarray) -> np.ndarray:
    """Convert one per-layer array of ours to the HF layout."""
    if m.kind == "linear":
        fan_in = math.prod(ours.shape[: m.in_dims])
        return np.ascontiguousarray(ours.reshape(fan_in, -1).T)
    if m.kind == "bias":
        return ours.reshape(-1)
    return ours


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory cannot be loaded; the message says why."""


class WeightFiles:
    """Every safetensors file of a checkpoint directory, looked up by tensor name."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        try:
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {f: SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
                self._where = {name: files[f] for name, f in weight_map.items()}
            elif single.is_file():
                f = SafetensorsFile(single)
                self._where = {name: f for name in f.keys()}
            else:
                raise CheckpointError(
                    f"no model.safetensors or model.safetensors.index.json in {path}"
                )
        except (SafetensorsError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read weights in {path}: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"checkpoint has no tensor {name}")
        return self._where[name].get(name)

    def dtype(self, name: str) -> np.dtype:
        return self._where[name].dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)


def _layer_names(m: TensorMap, cfg: ModelConfig) -> list[str]:
    return [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name]


def _get_var(model_state, path):
    node = model_state
    for key in path:
        node = node[key]
    return node


def load_hf_model(
    path: str | Path,
    mesh: Mesh | None = None,
    *,
    dtype=jnp.float32,
    remat: RematPolicy = "none",
    scan_layers: bool = True,
    rules=None,
    cfg: ModelConfig | None = None,
) -> tuple[Transformer, dict[str, np.dtype]]:
    """Load a local HF directory onto ``mesh`` as fp32 parameters.

    Each device receives only its shard (``jax.make_array_from_callback``); tensors are read
    lazily from memory-mapped files. Returns the model and the source dtype of every HF tensor
    (for exact re-export).
    """
    cfg = cfg or ModelConfig.from_pretrained(path)
    files = WeightFiles(path)
    abstract = abstract_model(cfg, dtype, remat, scan_layers)
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = model_shardings(abstract_state, mesh, rules)
    source_dtypes: dict[str, np.dtype] = {}

    for m in tensor_maps(cfg):
        var = _get_var(abstract_state, m.path)
        full_shape = var.get_raw_value().shape
        layer_shape = full_shape[1:] if m.stacked else full_shape
        names = _layer_names(m, cfg)
        for name in names:
            if name not in files:
                raise CheckpointError(f"checkpoint {path} is missing tensor {name}")
            expected = math.prod(layer_shape)
            if math.prod(files.shape(name)) != expected:
                raise CheckpointError(
                    f"tensor {name} has shape {files.shape(name)}, config implies "
                    f"{expected} elements ({layer_shape})"
                )
            source_dtypes[name] = files.dtype(name)
        cache: dict[int, np.ndarray] = {}

        def layer(i: int, m=m, names=names, layer_shape=layer_shape, cache=cache) -> np.ndarray:
            if i not in cache:
                raw = files.get(names[i]).astype(np.float32)
                cache[i] = hf_to_ours(m, raw, layer_shape)
            return cache[i]

        def shard(index, m=m, layer=layer):
            if not m.stacked:
                return layer(0)[index]
            rows = range(*index[0].indices(cfg.num_layers))
            return np.stack([layer(i)[index[1:]] for i in rows])

        sharding = _get_var(shardings, m.path) if not isinstance(shardings, NamedSharding) else shardings
        var.set_value(jax.make_array_from_callback(full_shape, sharding, shard))
    return nnx.merge(graphdef, abstract_state), source_dtypes


def _host_array(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x), dtype=np.float32)


def _cast(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(DTYPES[dtype] if isinstance(dtype, str) and dtype in DTYPES else np.dtype(dtype))


def hf_state_dict(model: Transformer, dtype="float32") -> dict[str, np.ndarray]:
    """All tensors in HF names and layout; ``dtype`` is one dtype or a dict per HF name."""
    cfg = model.cfg
    state = nnx.state(model, nnx.Param)
    out = {}
    for m in tensor_maps(cfg):
        value = _host_array(_get_var(state, m.path)[...])
        layers = list(value) if m.stacked else [value]
        for name, arr in zip(_layer_names(m, cfg), layers):
            target = dtype.get(name, "float32") if isinstance(dtype, dict) else dtype
            out[name] = _cast(ours_to_hf(m, arr), target)
    return out


def _shard_groups(tensors: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    groups, current, size = [], [], 0
    for name in tensors:
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    *,
    dtype="float32",
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write a directory ``AutoModelForCausalLM.from_pretrained`` loads, atomically.

    Files go to a temporary sibling directory which is then renamed into place, so a reader
    never sees a half-written export. An existing ``out_dir`` is replaced.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        cfg = model.cfg
        hf_cfg = cfg.to_hf_dict()
        if isinstance(dtype, str):
            hf_cfg["torch_dtype"] = np.dtype(DTYPES.get(dtype, dtype)).name
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        groups = _shard_groups(tensors, max_shard_bytes)
        if len(groups) == 1:
            save_safetensors(tmp / "model.safetensors", tensors)
        else:
            weight_map = {}
            for k, names in enumerate(groups, start=1):
                fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                save_safetensors(tmp / fname, {n: tensors[n] for n in names})
                weight_map.update({n: fname for n in names})
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                     "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
        os.chmod(tmp, 0o755)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is moved aside first, then removed."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, target)
