"""Model architecture read from a Hugging Face ``config.json``.

One ``ModelConfig`` covers the decoder-only families we support: ``qwen2`` (q/k/v bias),
``qwen3`` (q/k RMSNorm) and ``llama`` (Llama 3.x), with ``linear``, ``llama3`` or ``yarn``
rope scaling. Rope settings are resolved as transformers 5 does: a top-level ``rope_scaling``
replaces ``rope_parameters`` whole, and ``rope_theta`` inside the chosen dict wins over the
top-level one. ``generation_eos_ids`` reads the end-of-sequence ids a model lists in its
``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fields each scaled rope type needs (the others are optional, with transformers' defaults).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_ROPE_OPTIONAL = {"yarn": ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                           "mscale_all_dim", "truncate")}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class ModelConfigError(ValueError):
    """The Hugging Face config describes something we cannot build; the message names the field."""


# Largest config.json / generation_config.json read: real ones are kilobytes. Parsing JSON can
# take 25 times its size in memory (nested empty lists), and a pushed checkpoint's files are
# otherwise bounded only by the disk.
MAX_CONFIG_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of rotary embeddings: ``rope_type`` and the HF fields it uses
    (``params``, sorted (name, value) pairs so the config stays hashable)."""

    rope_type: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def from_hf(cls, rope: dict[str, Any], rope_type: str, field: str,
                max_position_embeddings: int) -> "RopeScaling":
        """Keep the fields of ``rope_type`` from HF ``rope`` (read from config field ``field``)."""
        missing = [k for k in _ROPE_REQUIRED[rope_type] if rope.get(k) is None]
        if missing:
            raise ModelConfigError(f"{field} of rope_type {rope_type} is missing {missing[0]!r}")
        keys = _ROPE_REQUIRED[rope_type] + _ROPE_OPTIONAL.get(rope_type, ())
        params = {k: _rope_param(rope, k, f"{field}.") for k in keys if rope.get(k) is not None}
        if rope_type == "yarn" and "factor" not in params:  # as transformers infers it
            params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
        if rope_type == "llama3" and params["low_freq_factor"] == params["high_freq_factor"]:
            raise ModelConfigError(f"{field}.low_freq_factor and high_freq_factor must differ, "
                                   f"both are {params['low_freq_factor']}")
        return cls(rope_type, tuple(sorted(params.items())))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a list in config.json becomes a tuple
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        # HF: Qwen2 has q/k/v bias and no o_proj bias; elsewhere attention_bias sets all four.
        if (self.qkv_bias, self.o_bias) != ((True, False) if self.model_type == "qwen2"
                                            else (self.qkv_bias, self.qkv_bias)):
            raise ModelConfigError(
                f"{self.model_type} cannot have qkv_bias={self.qkv_bias} with o_bias={self.o_bias}"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple (HF allows an int or a list)."""
        return _as_tuple(self.eos_token_id)

    @property
    def attention_break_even(self) -> int:
        """Row length at which a token's causal attention FLOPs equal its matmul FLOPs.

        Per token and layer, matmuls cost ~6 x (matmul weights of a layer) FLOPs (forward +
        backward) and attention over a packed row of T tokens ~6 x T x query width (each
        token sees T / 2 keys on average, two products).
        """
        d, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (d * (q + 2 * kv) + q * d + 3 * d * f) // q

    def num_params(self) -> int:
        """Parameter count (embeddings included)."""
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        attn += d if self.o_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return L * layer + self.vocab_size * d + d + head

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face ``config.json``; unsupported fields, and values
        of the wrong type or range (a non-integral size, a non-finite or non-positive epsilon,
        an EOS id outside the vocabulary), raise ``ModelConfigError`` naming the field."""
        if not isinstance(hf, dict):
            raise ModelConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED if k not in hf]
        if missing:
            raise ModelConfigError(f"config.json for {model_type} is missing field {missing[0]!r}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported; supported: silu")
        if hf.get("use_sliding_window"):
            raise ModelConfigError("use_sliding_window=true is not supported (full attention only)")
        if hf.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        if model_type == "llama" and hf.get("pretraining_tp", 1) != 1:
            raise ModelConfigError("pretraining_tp != 1 is not supported")

        max_positions = _integer(hf, "max_position_embeddings", 4096)
        rope_theta, rope_scaling = _rope(hf, max_positions)
        num_heads = _integer(hf, "num_attention_heads")
        hidden_size = _integer(hf, "hidden_size")
        vocab_size = _integer(hf, "vocab_size")
        qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=_integer(hf, "intermediate_size"),
            num_layers=_integer(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_integer(hf, "num_key_value_heads", num_heads),
            head_dim=_integer(hf, "head_dim", max(hidden_size // num_heads, 1)),
            rms_norm_eps=_positive(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=model_type != "qwen2" and qkv_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=_token_ids(hf, "bos_token_id", vocab_size),
            eos_token_id=_token_ids(hf, "eos_token_id", vocab_size),
            # Unused in the computation; -1 means none in some older Llama conversions.
            pad_token_id=None if hf.get("pad_token_id") == -1 else _token_ids(hf, "pad_token_id",
                                                                              None),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` from a local Hugging Face model directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        hf = read_json_file(file)
        try:
            return cls.from_hf_dict(hf)
        except ModelConfigError as e:
            raise ModelConfigError(f"{file}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents transformers needs to rebuild this architecture."""
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "llama": "LlamaForCausalLM"}[self.model_type]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta,
                    **dict(self.rope_scaling.params)}
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = rope
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        return out


def generation_eos_ids(path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """End-of-sequence ids in ``generation_config.json`` of the model directory ``path`` (none
    without that file). transformers and SGLang stop on these as well as on ``config.json``'s;
    Llama 3 Instruct lists ``<|eot_id|>`` only here. A file that is not a JSON object, or ids
    that are not non-negative integers below ``vocab_size``, raise ``ModelConfigError`` naming
    the file."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        if os.path.lexists(file):  # its end ids (Llama 3's <|eot_id|>) would be lost unseen
            raise ModelConfigError(f"{file} is not a regular file")
        return ()
    gen = read_json_file(file)
    if not isinstance(gen, dict):
        raise ModelConfigError(f"{file} must hold a JSON object, got {type(gen).__name__}")
    try:
        return _as_tuple(_token_ids(gen, "eos_token_id", vocab_size))
    except ModelConfigError as e:
        raise ModelConfigError(f"{file}: {e}") from None


def read_json_file(file: Path, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """The JSON value in ``file``, which must hold at most ``max_bytes``; else (or when it does
    not parse) ``ModelConfigError`` naming the file."""
    with open(file, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ModelConfigError(f"{file} is over {max_bytes >> 20} MiB, more than such a file "
                               "ever holds: not read")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
        raise ModelConfigError(f"{file} is not valid JSON: {e!s:.200}") from e


def _as_tuple(ids: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """Token ids as a tuple: none, one id, or several."""
    if ids is None:
        return ()
    return (ids,) if isinstance(ids, int) else tuple(ids)


def _rope(hf: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope theta, scaling) from a config dict, resolved as transformers 5 does."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if not isinstance(hf.get(field) or {}, dict):
        raise ModelConfigError(f"{field} must be a dict, got {hf[field]!r}")
    rope = dict(hf.get(field) or {})
    rope_theta = _number(rope if "rope_theta" in rope else hf, "rope_theta", 10000.0,
                         f"{field}." if "rope_theta" in rope else "")
    if rope_theta <= 1:  # every frequency would be 1, and yarn's range divides by log(theta)
        raise ModelConfigError(f"rope_theta must be > 1, got {rope_theta}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{field}.rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):  # the pretraining length, as transformers resolves it:
        if hf.get("original_max_position_embeddings") is not None:  # a top-level one wins
            rope["original_max_position_embeddings"] = _integer(
                hf, "original_max_position_embeddings")
        elif rope.get("original_max_position_embeddings") is None:  # else the model's length
            rope["original_max_position_embeddings"] = max_positions
    return rope_theta, RopeScaling.from_hf(rope, rope_type, field, max_positions)


def _number(hf: dict[str, Any], key: str, default: float | None = None,
            where: str = "") -> float:
    """``hf[key]`` (``default`` where absent or null), a finite int or float."""
    value = hf.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"{where}{key} must be a number, got {value!r:.80}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite:
        raise ModelConfigError(f"{where}{key} must be finite, got {value!s:.80}")
    return value


def _integer(hf: dict[str, Any], key: str, default: int | None = None, where: str = "") -> int:
    """``hf[key]`` as a positive integer (an integral float such as 4096.0 is accepted)."""
    value = _number(hf, key, default, where)
    if value != int(value) or value < 1:
        raise ModelConfigError(f"{where}{key} must be a positive integer, got {value}")
    return int(value)


def _positive(hf: dict[str, Any], key: str, default: float | None = None, where: str = "") -> float:
    value = _number(hf, key, default, where)
    if value <= 0:
        raise ModelConfigError(f"{where}{key} must be > 0, got {value}")
    return float(value)


def _rope_param(rope: dict[str, Any], key: str, where: str):
    """A rope scaling field: a flag, a position count, or a finite number (positive for the
    factors)."""
    if key == "truncate":
        if not isinstance(rope[key], bool):
            raise ModelConfigError(f"{where}{key} must be true or false, got {rope[key]!r:.80}")
        return rope[key]
    if key == "original_max_position_embeddings":
        return _integer(rope, key, where=where)
    if key in ("mscale", "mscale_all_dim"):
        return _number(rope, key, where=where)
    return _positive(rope, key, where=where)


def _token_ids(hf: dict[str, Any], key: str, vocab_size: int | None):
    """An id, or a list of ids as a tuple (the config stays hashable: it is part of jit keys);
    each a non-negative integer, below ``vocab_size`` where given (an EOS id the model can
    never emit would never end a generation)."""
    value = hf.get(key)
    if value is None:
        return None
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (
                vocab_size is not None and i >= vocab_size):
            bound = f" below vocab_size {vocab_size}" if vocab_size is not None else ""
            raise ModelConfigError(f"{key} must hold non-negative integer ids{bound}, got "
                                   f"{value!r:.80}")
    return tuple(ids) if isinstance(value, (list, tuple)) else value
