"""Reward functions by name.

A reward function is ``fn(completion: str, metadata: dict) -> float``. Names resolve in this
order: functions registered with :func:`register_reward`, the built-ins (imported on first use so
that e.g. math-verify loads only where the math reward runs), then a Python dotted path
``"pkg.module:function"`` or ``"pkg.module.function"``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, dict], float]

_BUILTINS: dict[str, str] = {
    "math": "areal_jax.rewards.math_answer:math_reward",
    "code": "areal_jax.rewards.code_tests:code_reward",
    "code_fraction": "areal_jax.rewards.code_tests:code_fraction_reward",
    "synthetic_arith": "areal_jax.data.synthetic:synthetic_arith_reward",
}
_REGISTERED: dict[str, RewardFn] = {}


class RewardNotFoundError(LookupError):
    """A reward name is neither registered, built in, nor an importable dotted path."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; re-registering the same function is a no-op."""
    if not name or not isinstance(name, str):
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _BUILTINS:
            raise ValueError(f"reward name {name!r} is taken by a built-in reward")
        existing = _REGISTERED.get(name)
        if existing is not None and reward_path(existing) != reward_path(fn):
            raise ValueError(
                f"reward name {name!r} is already registered to {reward_path(existing)}"
            )
        _REGISTERED[name] = fn
        return fn

    return decorator


def available_rewards() -> list[str]:
    """Names usable with :func:`get_reward` (dotted paths work too but are not listed)."""
    return sorted(set(_BUILTINS) | set(_REGISTERED))


def get_reward(name: str) -> RewardFn:
    """The reward function for a registered name, a built-in name or a dotted path."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        return import_path(_BUILTINS[name])
    if ":" in name or "." in name:
        return import_path(name)
    raise RewardNotFoundError(
        f"reward {name!r} is not registered; available: {', '.join(available_rewards())} "
        "(or give a dotted path 'pkg.module:function')"
    )


def import_path(path: str) -> RewardFn:
    """Import ``"pkg.module:attr"`` or ``"pkg.module.attr"`` and check it is callable."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardNotFoundError(f"reward path {path!r} is not of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardNotFoundError(
            f"reward path {path!r}: cannot import {module_name!r}: {e}"
        ) from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardNotFoundError(
                f"reward path {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise RewardNotFoundError(
            f"reward path {path!r} names a {type(obj).__name__}, not a function"
        )
    return obj


def reward_path(fn: RewardFn) -> str:
    """The importable ``"module:qualname"`` of ``fn``, used to rebuild it in worker processes."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"reward function {fn!r} cannot be imported by name; define it at module level"
        )
    return f"{module}:{qualname}"
