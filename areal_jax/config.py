"""Typed dataclass configs loaded from YAML with ``key=value`` command-line overrides.

Every config in the project is a (possibly nested) dataclass. ``from_dict`` builds one from
plain data and rejects unknown keys and ill-typed values with an error that names the dotted
key; ``load_config`` reads YAML and applies overrides such as ``trainer.lr=1e-5``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the dotted key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # X | None: X's own error, e.g. the unknown key deep inside
            return _coerce(value, options[0], key)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} matches none of {_type_name(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            items = [_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:  # NaN or infinity (1e400 reads as one) passes every range check after it
            if math.isfinite(number):
                return float(number)
        except OverflowError:  # an integer beyond any float
            pass
        raise ConfigError(f"{key}: expected a finite number, got {value!s:.80}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        hint = (" (YAML reads yes/no/on/off/true/false, and null, as such: quote the text, "
                "on the command line as key='\"yes\"')" if isinstance(value, bool) or value is None
                else " (YAML reads 'text: more' as a mapping: quote text holding ': ', on the "
                "command line as key='\"text: more\"')" if isinstance(value, dict)
                else "")
        raise ConfigError(f"{key}: expected a string, got {value!r}{hint}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def _did_you_mean(cls: type, key: Any, where: str) -> str:
    """A hint for the unknown ``key`` of ``cls``: the sections below that hold a field of that
    name, or the key without a leading ``+`` (another tool's way to add a key)."""
    name = str(key)
    if name.startswith("+"):
        return " (drop the '+': key=value sets any key)"
    found = [f"{where}{path}" for path in _field_paths(cls) if path.rsplit(".", 1)[-1] == name]
    return f" (did you mean {' or '.join(found[:3])}?)" if found else ""


def _field_paths(cls: type, depth: int = 3) -> list[str]:
    """The dotted names of every field of dataclass ``cls`` and of the dataclasses it holds."""
    paths = []
    for name, tp in typing.get_type_hints(cls).items():
        paths.append(name)
        nested = [t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)]
        if nested and depth > 1:
            paths += [f"{name}.{p}" for p in _field_paths(nested[0], depth - 1)]
    return paths


def from_dict(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys may be numbers
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]!s}{_did_you_mean(cls, unknown[0], where)}; "
            f"valid keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"missing required config key {where}{missing[0]}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not prefix or str(e).startswith(prefix):
            raise
        raise ConfigError(_in_section(prefix, str(e), fields)) from e
    except (ValueError, TypeError) as e:
        if not prefix:
            raise ConfigError(f"{cls.__name__}: {e}") from e
        raise ConfigError(_in_section(prefix, str(e), fields)) from e


def _in_section(prefix: str, message: str, fields) -> str:
    """``message`` of a check in section ``prefix``: ``prefix.key: must ...`` where it reads
    ``key must ...`` for one of the section's keys (``lr must be > 0`` -> ``trainer.lr: must
    be > 0``), else ``prefix: message``."""
    key, _, rest = message.partition(" ")
    if key in fields and rest.startswith("must "):
        return f"{prefix}.{key}: {rest}"
    return f"{prefix}: {message}"


def to_dict(cfg: Any) -> Any:
    """Plain-data (YAML/JSON-able) view of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to nested ``data``; values are parsed as YAML scalars."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = _read_yaml(raw, f"override {key}") if raw.strip() else ""
        except RecursionError:  # the parser recurses once per level of nesting
            raise ConfigError(f"override {key}: its value is nested too deep to read") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: its value {raw!r:.200} is not valid YAML "
                              f"({_yaml_problem(e)}); quote a value holding spaces so the shell "
                              "passes it whole, e.g. 'key={a: 1}'") from None
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a mapping")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Read YAML at ``path`` (or start empty), apply overrides, build ``cls``."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = _read_yaml(path.read_text(encoding="utf-8"), f"config file {path}")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not valid UTF-8 ({e.reason} at byte "
                              f"{e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({_yaml_problem(e)})") from None
        except RecursionError:  # the parser recurses once per level of nesting
            raise ConfigError(f"config file {path}: nested too deep to read") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    return from_dict(cls, apply_overrides(data, list(overrides)))


def _read_yaml(text: str, where: str):
    """``yaml.safe_load(text)``, parsed once, its aliases checked (``_check_expansion``;
    ``where`` names the text in its errors) before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        _check_expansion(node, where)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


MAX_CONFIG_VALUES = 100_000  # values of a config file, aliases (``*name``) expanded


def _check_expansion(root: yaml.Node | None, where: str) -> None:
    """Refuse a document whose aliases expand it past ``MAX_CONFIG_VALUES`` values (a few
    lines of nested aliases can stand for billions: every later pass over the config would
    hang) or make it contain itself."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise ConfigError(f"{where}: an alias at line {node.start_mark.line + 1} makes the "
                              "document contain itself")
        visiting.add(key)
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v) for v in node.value)
        else:
            n = 1
        visiting.discard(key)
        sizes[key] = n = min(n, MAX_CONFIG_VALUES + 1)
        return n

    if root is not None and size(root) > MAX_CONFIG_VALUES:
        raise ConfigError(f"{where}: its aliases (*name) expand it to more than "
                          f"{MAX_CONFIG_VALUES} values")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the YAML parser found wrong, and where (line and column from 1)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
