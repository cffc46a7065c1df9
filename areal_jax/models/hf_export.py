"""Export to a Hugging Face directory: device -> host tensors in the target dtype, then files.

Two steps so the slow one can leave the training thread: ``hf_state_dict`` snapshots the
parameters to host arrays in the serving dtype (cast and transposed on the devices, one
tensor at a time), and ``export_hf_tensors`` writes those arrays atomically.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import check_tensors
from areal_jax.models.hf_names import (
    DTYPE_ALIASES, TensorMap, get_var, hf_shapes, layer_names, tensor_maps,
)
from areal_jax.models.safetensors_io import save_safetensors
from areal_jax.models.transformer import Transformer
from areal_jax.parallel.multihost import host_array

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",  # SentencePiece (Llama 2 style): the vocabulary of such tokenizers
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
)
_BY_ALIAS = {alias: d for d, aliases in DTYPE_ALIASES.items() for alias in aliases}
_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json",
                *TOKENIZER_FILES}


class ExportTargetError(ValueError):
    """An export's output directory holds something other than a model's files."""


def check_export_target(out_dir: str | Path) -> None:
    """Raise ``ExportTargetError`` unless ``out_dir`` is absent, empty, or a model directory
    (config, safetensors and tokenizer files only): an export replaces its output directory
    whole, and must never take a run directory or anything else with it."""
    out_dir = Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink():
        raise ExportTargetError(f"{out_dir} is a symbolic link; an export replaces its output "
                                "directory: give the link's target, or a new path")
    if not out_dir.is_dir():
        raise ExportTargetError(f"{out_dir} exists and is not a directory; an export writes a "
                                "directory: choose a new path")
    foreign = sorted(p.name for p in out_dir.iterdir()
                     if p.is_symlink() or not p.is_file()
                     or not (p.name in _MODEL_FILES or p.name.endswith(".safetensors")))
    if foreign:
        raise ExportTargetError(
            f"{out_dir} holds {foreign[0]!r} ({len(foreign)} entries that are not a model's "
            "files): an export replaces its output directory whole, so it must be new, empty or "
            "an earlier export; choose another path")


def export_dtype(spec) -> np.dtype:
    """The float dtype named by ``spec``: an alias such as ``"bf16"``/``"BF16"``, or a dtype."""
    if isinstance(spec, str):
        found = _BY_ALIAS.get(spec.lower())
    else:
        try:
            found = np.dtype(spec)
        except TypeError:
            found = None
    if found not in DTYPE_ALIASES:
        allowed = "; ".join(f"{d.name} ({', '.join(a[1:])})" for d, a in DTYPE_ALIASES.items())
        raise ValueError(f"dtype {spec!r} cannot be exported; allowed: {allowed}")
    return found


@functools.partial(jax.jit, static_argnames=("m", "dtype"))
def _hf_layout(m: TensorMap, x: jax.Array, dtype: np.dtype) -> jax.Array:
    """Our (stacked if ``m.stacked``) array ``x`` cast to ``dtype`` in HF layout, on device."""
    x = x.astype(dtype)
    x = x if m.stacked else x[None]
    if m.kind == "linear":
        fan_in = int(np.prod(x.shape[1 : 1 + m.in_dims]))
        x = x.reshape(x.shape[0], fan_in, -1).swapaxes(1, 2)
    elif m.kind == "bias":
        x = x.reshape(x.shape[0], -1)
    return x if m.stacked else x[0]


@functools.partial(jax.jit, static_argnames=("m", "dtype"))
def _hf_layer(m: TensorMap, x: jax.Array, i: jax.Array, dtype: np.dtype) -> jax.Array:
    """Layer ``i`` of stacked ``x`` cast to ``dtype`` in HF layout (one program for every i)."""
    return _hf_layout(m, jax.lax.dynamic_index_in_dim(x, i, keepdims=True), dtype)[0]


def hf_state_dict(model: Transformer, dtype="float32", keep: bool = True
                  ) -> dict[str, np.ndarray]:
    """Host copies of all tensors in HF names and layout.

    ``dtype`` is one dtype or ``{hf_name: dtype}`` (float32 where a name is absent). Each
    tensor is converted on its devices and copied to the host in the target dtype, so a bf16
    export never holds an fp32 copy of the model. The arrays do not alias the parameters.

    Parameters spread over several processes are gathered a layer at a time (a gather
    replicates what it gathers on every device: a whole stacked tensor could exceed a
    device's memory); every process must call this, and ``keep=False`` (processes other than
    the one writing the export) takes part in the gathers without holding the tensors.
    """
    cfg = model.cfg
    state = nnx.state(model, nnx.Param)
    out: dict[str, np.ndarray] = {}
    for m in tensor_maps(cfg):
        names = layer_names(m, cfg)
        value = get_var(state, m.path)[...]
        targets = [export_dtype(dtype.get(n, "float32") if isinstance(dtype, dict) else dtype)
                   for n in names]
        if len(set(targets)) == 1 and (value.is_fully_addressable or not m.stacked):
            host = host_array(_hf_layout(m, value, targets[0]))
            if keep:
                out.update(zip(names, host if m.stacked else [host]))
            continue
        for i, (name, target) in enumerate(zip(names, targets)):  # a layer at a time
            host = host_array(_hf_layer(m, value, np.int32(i), target))
            if keep:
                out[name] = host
    return out


def _main_dtype(tensors: dict[str, np.ndarray]) -> np.dtype:
    """The dtype holding most of the parameters (the only one, in a uniform export)."""
    counts: collections.Counter = collections.Counter()
    for t in tensors.values():
        counts[export_dtype(t.dtype)] += t.size
    return counts.most_common(1)[0][0]


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


def remove_unfinished_exports(parent: str | Path, name: str = "*") -> list[Path]:
    """Delete the temporary directories that exports into ``parent`` (of directories matching
    ``name``) left unfinished: a writer killed mid-export leaves ``.<name>.tmp-*``, and one
    killed as it replaced an export the old one, ``.<name>.old-*``. Only for a caller that
    knows no export into ``parent`` is in progress; returns what it deleted."""
    parent = Path(parent)
    doomed = [p for kind in ("tmp", "old") for p in parent.glob(f".{name}.{kind}-*")
              if p.is_dir()] if parent.is_dir() else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def export_hf_tensors(
    tensors: dict[str, np.ndarray],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    source_dir: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    durable: bool = True,
) -> Path:
    """Write HF-named host ``tensors`` of a ``cfg`` model as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads, atomically (``durable``: each weight file
    synced to disk before the rename).

    The tensors must be exactly those of ``cfg`` (``CheckpointError`` otherwise).
    ``config.json`` declares the tensors' dtype (``dtype`` and ``torch_dtype``), so
    transformers loads them as written. ``generation_config.json`` is that of the model directory
    ``source_dir`` (the one the parameters were loaded from) where it has one, copied unchanged,
    else built from ``cfg``'s token ids. Files go to a temporary sibling directory which is
    then renamed into place; an existing ``out_dir`` is replaced if it holds a model's files
    only (``ExportTargetError`` otherwise).
    """
    out_dir = Path(out_dir)
    found = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    check_tensors(found, hf_shapes(cfg), cfg, f"export to {out_dir}")
    check_export_target(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        hf_cfg = cfg.to_hf_dict()
        hf_cfg["dtype"] = hf_cfg["torch_dtype"] = _main_dtype(tensors).name
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        source_gen = Path(source_dir) / "generation_config.json" if source_dir else None
        if source_gen is not None and source_gen.is_file():
            shutil.copy2(source_gen, tmp / "generation_config.json")
        else:
            gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        groups = _shard_groups(tensors, max_shard_bytes)
        if len(groups) == 1:
            save_safetensors(tmp / "model.safetensors", tensors, durable=durable)
        else:
            weight_map = {}
            for k, names in enumerate(groups, start=1):
                fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                save_safetensors(tmp / fname, {n: tensors[n] for n in names}, durable=durable)
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


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    *,
    dtype="float32",
    tokenizer_dir: str | Path | None = None,
    source_dir: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """``export_hf_tensors(hf_state_dict(model, dtype), model.cfg, out_dir, ...)``."""
    return export_hf_tensors(hf_state_dict(model, dtype), model.cfg, out_dir,
                             tokenizer_dir=tokenizer_dir, source_dir=source_dir,
                             max_shard_bytes=max_shard_bytes)


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is moved aside first, then removed."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, target)
