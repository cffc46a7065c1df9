"""Load a Hugging Face safetensors checkpoint straight onto a sharded model, validated.

Before any weight is read, every tensor the model needs is checked against the checkpoint's
headers (present, exact shape, float dtype), and every tensor the model would not use is an
error: a checkpoint that only loads by dropping or reshaping something would give wrong
logits. Values are checked to be finite as each tensor is read.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from areal_jax.models.build import abstract_model
from areal_jax.models.config import ModelConfig, read_json_file
from areal_jax.models.hf_names import (
    DTYPE_ALIASES, TensorMap, get_var, hf_shapes, hf_to_ours, layer_names, tensor_maps,
)
from areal_jax.models.safetensors_io import MAX_HEADER_BYTES, SafetensorsError, SafetensorsFile
from areal_jax.models.safetensors_io import header_bytes
from areal_jax.models.transformer import RematPolicy, Transformer
from areal_jax.parallel.sharding import model_shardings

FLOAT_DTYPES = tuple(DTYPE_ALIASES)
# Buffers some exporters write that carry no weights (recomputed from the config).
_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)
_TIED_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


# Largest model.safetensors.index.json read: a 671B-parameter model's lists 90k tensors in 9 MB.
MAX_INDEX_BYTES = 64 << 20


class CheckpointError(ValueError):
    """Hugging Face tensors do not fit the model (or cannot be read); the message says why."""


class WeightFiles:
    """Every safetensors file of a checkpoint directory, looked up by tensor name."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        try:
            if index.is_file():
                weight_map = read_json_file(index, MAX_INDEX_BYTES)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index.name}: weight_map is not a JSON object")
                for name, f in weight_map.items():  # never a file outside the checkpoint
                    if not isinstance(f, str) or Path(f).name != f or f in ("", ".", ".."):
                        raise CheckpointError(f"{index.name}: tensor {name} is mapped to "
                                              f"{f!r:.80}, not a file name in {path}")
                names = sorted(set(weight_map.values()))
                headers = sum(header_bytes(path / f) for f in names)  # before any is parsed
                if headers > MAX_HEADER_BYTES:
                    raise CheckpointError(
                        f"the {len(names)} weights files of {path} have headers of {headers} "
                        f"bytes in all, more than {MAX_HEADER_BYTES} (no real checkpoint's "
                        "come close): not read")
                files = {f: SafetensorsFile(path / f) for f in names}
                self._where = {name: files[f] for name, f in weight_map.items()}
            elif single.is_file():
                f = SafetensorsFile(single)
                self._where = {name: f for name in f.keys()}
            else:
                raise CheckpointError(
                    f"no model.safetensors or model.safetensors.index.json in {path}"
                )
        except CheckpointError:
            raise
        except (SafetensorsError, KeyError, TypeError, ValueError, RecursionError) as e:
            # ValueError: an index that is not JSON or not UTF-8
            raise CheckpointError(f"cannot read weights in {path}: {e!s:.300}") from e
        for name, f in self._where.items():
            if name not in f:
                raise CheckpointError(
                    f"the index lists tensor {name} in {f.path.name}, which lacks it"
                )
        for f in set(self._where.values()):  # a tensor the index hides would go unchecked
            hidden = sorted(n for n in f.keys() if self._where.get(n) is not f
                            and not n.endswith(_HARMLESS_SUFFIXES))
            if hidden:
                raise CheckpointError(
                    f"{f.path.name} holds tensors the index does not list there: "
                    f"{', '.join(hidden[:5])}" + (" ..." if len(hidden) > 5 else ""))

    def names(self) -> list[str]:
        return list(self._where)

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


def check_tensors(found: dict[str, tuple[tuple[int, ...], np.dtype]],
                  expected: dict[str, tuple[int, ...]], cfg: ModelConfig, where: str) -> None:
    """Raise ``CheckpointError`` unless ``found`` ({name: (shape, dtype)}) holds exactly the
    ``expected`` {name: HF shape} in float dtypes, apart from rotary-frequency buffers."""
    allowed = ", ".join(d.name for d in FLOAT_DTYPES)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{where} is missing tensor {name}")
        if found[name][0] != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {found[name][0]}, the config implies {shape}"
            )
        if found[name][1] not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{where}: tensor {name} has dtype {found[name][1].name}; supported: {allowed}"
            )
    unused = sorted(n for n in found if n not in expected and not n.endswith(_HARMLESS_SUFFIXES))
    if unused:
        more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
        raise CheckpointError(
            f"{where} has tensors the {cfg.model_type} config does not use: "
            f"{', '.join(unused[:5])}{more}"
        )


_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")  # longer: an unused tensor


def _check_layer_count(files: WeightFiles, cfg: ModelConfig, path) -> None:
    """``CheckpointError`` when a layer below ``cfg.num_layers`` has no tensor in the files,
    before the expected names are built: a config naming a billion layers would otherwise
    build a billion layers' names first (layers beyond it are reported with the other unused
    tensors, by name)."""
    layers = {int(m.group(1)) for n in files.names() if (m := _LAYER.match(n))}
    # the first missing index is at most len(layers): never more than that many are looked at
    first = next((i for i in range(cfg.num_layers) if i not in layers), None)
    if first is not None:
        raise CheckpointError(
            f"checkpoint {path}: missing tensor model.layers.{first}.*: config.json has "
            f"num_hidden_layers {cfg.num_layers}, and the weights hold {len(layers)} layers")


def _checkpoint_tensors(files: WeightFiles, cfg: ModelConfig,
                        compare_tied_head: bool = True) -> dict:
    """{name: (shape, dtype)} of ``files``, less an ``lm_head.weight`` that only repeats the
    tied embedding (some exporters write it; ``compare_tied_head`` False: taken as such from
    its shape, without reading either tensor)."""
    found = {n: (files.shape(n), files.dtype(n)) for n in files.names()}
    if cfg.tie_word_embeddings and _TIED_HEAD in found and _EMBED in found:
        same = found[_TIED_HEAD][0] == found[_EMBED][0]
        if same and compare_tied_head:
            same = np.array_equal(files.get(_TIED_HEAD).astype(np.float32),
                                  files.get(_EMBED).astype(np.float32))
        if not same:
            raise CheckpointError(
                f"tensor {_TIED_HEAD} differs from {_EMBED}, but tie_word_embeddings is true"
            )
        del found[_TIED_HEAD]
    return found


def count_non_finite(a: np.ndarray) -> int:
    """NaN and Inf values in a float array (bfloat16 counted on its bits, which is several
    times faster than NumPy's generic loop for it)."""
    if a.dtype == ml_dtypes.bfloat16:
        return int(np.count_nonzero((a.view(np.uint16) & 0x7F80) == 0x7F80))
    return a.size - int(np.count_nonzero(np.isfinite(a)))


def _read(files: WeightFiles, name: str) -> np.ndarray:
    """One HF tensor as it is in the file; non-finite values raise."""
    raw = files.get(name)
    bad = count_non_finite(raw)
    if bad:
        raise CheckpointError(f"tensor {name} has {bad} non-finite values (NaN or Inf)")
    return raw


@functools.partial(jax.jit, static_argnames="dtype")
def _cast(x: jax.Array, dtype: np.dtype) -> tuple[jax.Array, jax.Array | None]:
    """``x`` in ``dtype`` and, for a narrowing cast, whether every value is still finite there
    (values finite in a file can be beyond a narrower dtype's range: fp32 near its max into
    bf16); None for a widening one."""
    y = x.astype(dtype)
    narrowing = jnp.finfo(dtype).max < jnp.finfo(x.dtype).max
    return y, (jnp.isfinite(y).all() if narrowing else None)


def _widest(dtypes) -> np.dtype:
    """The dtype that holds every one of ``dtypes`` exactly: numpy's promotion, or float32 for
    a mix numpy does not promote (bfloat16 beside float16)."""
    dtypes = list(dtypes)
    try:
        return np.result_type(*dtypes)
    except TypeError:  # numpy's DTypePromotionError
        return np.dtype(np.float32)


def _place(files: WeightFiles, m: TensorMap, names: list[str], full_shape: tuple[int, ...],
           sharding, dtype: np.dtype) -> jax.Array:
    """Parameter ``m`` on its sharding, in ``dtype``.

    Each device receives only its shard, laid out on the host in the file's dtype (the widest
    among the layers of a mixed checkpoint); a cast, where one is needed, runs on device.
    """
    layer_shape = full_shape[1:] if m.stacked else full_shape
    source = _widest(files.dtype(n) for n in names)
    cache: dict[int, np.ndarray] = {}

    def layer(i: int) -> np.ndarray:
        if i not in cache:
            cache[i] = hf_to_ours(m, _read(files, names[i]).astype(source, copy=False),
                                  layer_shape)
        return cache[i]

    @functools.cache  # devices that hold the same shard share one host copy
    def shard_of(index: tuple[tuple, ...]) -> np.ndarray:
        index = tuple(slice(*s) for s in index)
        if not m.stacked:
            return layer(0)[index]
        rows = range(*index[0].indices(len(names)))
        if all(i == slice(None) for i in index[1:]):  # whole layers: lay them out in place
            out = np.empty((len(rows), *layer_shape), source)
            for j, i in enumerate(rows):
                hf_to_ours(m, _read(files, names[i]), layer_shape, out=out[j])
            return out
        return np.stack([layer(i)[index[1:]] for i in rows])

    def shard(index):
        return shard_of(tuple((s.start, s.stop, s.step) for s in index))

    placed = jax.make_array_from_callback(full_shape, sharding, shard)
    if placed.dtype == dtype:
        return placed
    cast, finite = _cast(placed, dtype)
    if finite is not None and not bool(finite):
        which = names[0] if len(names) == 1 else f"{names[0]} (or another layer's)"
        raise CheckpointError(f"tensor {which} has values beyond the range of {dtype.name}")
    return cast


def check_hf_weights(path: str | Path, cfg: ModelConfig | None = None) -> None:
    """The weight files of the HF directory ``path`` against its config (``cfg``: read from
    it), from their headers: every tensor the config implies, with its shape and a float
    dtype, and no other. Raises ``CheckpointError``; the values are checked as they load."""
    cfg = cfg or ModelConfig.from_pretrained(path)
    files = WeightFiles(path)
    _check_layer_count(files, cfg, path)  # before anything is built per layer
    found = _checkpoint_tensors(files, cfg, compare_tied_head=False)
    check_tensors(found, hf_shapes(cfg), cfg, f"checkpoint {path}")


def load_hf_model(
    path: str | Path,
    mesh: Mesh | None = None,
    *,
    dtype=jnp.float32,
    remat: RematPolicy = "none",
    scan_layers: bool = True,
    rules=None,
    cfg: ModelConfig | None = None,
    param_dtype=jnp.float32,
) -> tuple[Transformer, dict[str, np.dtype]]:
    """Load a local HF directory onto ``mesh`` as ``param_dtype`` parameters (computing in
    ``dtype``).

    Each device receives only its shard (``jax.make_array_from_callback``) of tensors read
    from memory-mapped files, in the file's dtype; the cast runs on device. Returns the model
    and the source dtype of every HF tensor (for exact re-export). Any problem raises
    ``CheckpointError`` and returns nothing.
    """
    cfg = cfg or ModelConfig.from_pretrained(path)
    files = WeightFiles(path)
    _check_layer_count(files, cfg, path)  # before anything is built per layer
    abstract = abstract_model(cfg, dtype, remat, scan_layers)
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    shardings = model_shardings(abstract_state, mesh, rules)

    expected = hf_shapes(cfg, abstract_state)
    check_tensors(_checkpoint_tensors(files, cfg), expected, cfg, f"checkpoint {path}")
    source_dtypes = {name: files.dtype(name) for name in expected}

    for m in tensor_maps(cfg):
        var = get_var(abstract_state, m.path)
        sharding = shardings if isinstance(shardings, NamedSharding) else get_var(shardings, m.path)
        names = layer_names(m, cfg)
        var.set_value(_place(files, m, names, var.get_raw_value().shape, sharding,
                             np.dtype(param_dtype)))
    return nnx.merge(graphdef, abstract_state), source_dtypes
