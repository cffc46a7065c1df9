"""Reward functions by name, and which names a run may call.

A reward function is ``fn(completion: str, metadata: dict) -> float``. :func:`get_reward`
resolves only functions registered with :func:`register_reward` and the built-ins (imported on
first use so that e.g. math-verify loads only where the math reward runs). A reward name arrives
in client requests, so a dotted path ``"pkg.module:function"`` is never imported because a
request names it: it must be listed in the config (``custom``: name -> dotted path), where
:func:`check_custom` imports and checks it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping

from areal_jax.config import ConfigError

# The largest reward magnitude a server scores and a trainer trains on: a group's rewards, their
# spread and the advantages of estimators that do not normalise stay far inside float32.
MAX_ABS_REWARD = 1e9

RewardFn = Callable[[str, dict], float]

_BUILTINS: dict[str, str] = {
    "math": "areal_jax.rewards.math_answer:math_reward",
    "code": "areal_jax.rewards.code_tests:code_reward",
    "code_fraction": "areal_jax.rewards.code_tests:code_fraction_reward",
    "synthetic_arith": "areal_jax.data.synthetic:synthetic_arith_reward",
}
_REGISTERED: dict[str, RewardFn] = {}


class RewardNotFoundError(LookupError):
    """A reward name is neither registered, built in, nor configured."""


class RewardConfigError(ConfigError):
    """A configured reward cannot be used; the message says why (e.g. the real import error)."""


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
    """Names usable with :func:`get_reward`: the built-ins and the registered names."""
    return sorted(set(_BUILTINS) | set(_REGISTERED))


def get_reward(name: str) -> RewardFn:
    """The reward function for a registered or built-in name; anything else raises."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        return import_path(_BUILTINS[name])
    if isinstance(name, str) and (":" in name or "." in name):
        module, _, function = name.rpartition(".")
        hint = (f" (a path names the function after a colon: '{module}:{function}', or "
                f"'{name}:<function>' where {name} is the module)"
                if ":" not in name and module else "")
        raise RewardNotFoundError(
            f"reward {name!r} looks like a dotted path{hint}; paths must be registered in config "
            "(a dataset's reward as 'pkg.module:function', or rewards.custom; see "
            "docs/rewards.md): one is never imported because a request names it"
        )
    raise RewardNotFoundError(
        f"reward {name!r} is not registered; available: {', '.join(available_rewards())}, or "
        "your own function as 'pkg.module:function'"
    )


def check_custom(custom: Mapping[str, str] | None) -> dict[str, str]:
    """Validate ``custom`` (name -> ``"pkg.module:function"``) by importing every path.

    Returns name -> path where each path is also a name of its own, so that a config may name
    a reward by its path. Raises RewardConfigError with the real import error.
    """
    table: dict[str, str] = {}
    for name, path in (custom or {}).items():
        if not isinstance(name, str) or not name:
            raise RewardConfigError(f"custom reward name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise RewardConfigError(f"custom reward {name!r}: path must be a non-empty string")
        for alias in (name, path):
            if alias in _BUILTINS:
                raise RewardConfigError(
                    f"custom reward {name!r}: {alias!r} is the name of a built-in reward"
                )
            if table.get(alias, path) != path:
                raise RewardConfigError(
                    f"custom reward {alias!r} is configured twice: {table[alias]!r} and {path!r}"
                )
            table[alias] = path
        try:
            fn = import_path(path)
        except RewardConfigError as e:
            if name == path:  # the error names it already
                raise
            raise RewardConfigError(f"custom reward {name!r}: {e}") from e
        registered = _REGISTERED.get(name)
        if registered is not None and reward_path(registered) != reward_path(fn):
            raise RewardConfigError(
                f"custom reward {name!r} ({path}) clashes with the registered "
                f"{reward_path(registered)}"
            )
    return table


def check_reward(name: str, custom: Mapping[str, str] | None = None) -> None:
    """Raise RewardConfigError saying why ``name`` cannot be scored with ``custom`` configured.

    A dotted-path ``name`` is accepted only when it is a key or a value of ``custom``.
    """
    if name in check_custom(custom):
        return
    try:
        get_reward(name)
    except RewardNotFoundError as e:
        raise RewardConfigError(str(e)) from None


def import_path(path: str) -> RewardFn:
    """Import ``"pkg.module:attr"`` or ``"pkg.module.attr"`` and check it is callable.

    Only for trusted paths (built-ins and config): importing runs the module's code.
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardConfigError(f"reward path {path!r} is not of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the module's own error (ImportError, SyntaxError, ...) is the cause
        hint = (" (is its directory on PYTHONPATH? e.g. PYTHONPATH=$PWD for a package next to "
                "you)" if isinstance(e, ModuleNotFoundError) and e.name
                and f"{module_name}.".startswith(f"{e.name}.") else "")
        raise RewardConfigError(
            f"reward path {path!r}: cannot import {module_name!r}: {type(e).__name__}: {e}{hint}"
        ) from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise RewardConfigError(f"reward path {path!r}: {e}") from None
    if not callable(obj):
        raise RewardConfigError(
            f"reward path {path!r} names an object of type {type(obj).__name__}, not a function"
        )
    _check_reward_signature(obj, path, attr)
    return obj


def _check_reward_signature(fn: Callable, path: str, attr: str) -> None:
    """Raise RewardConfigError when ``fn`` cannot be called as ``fn(completion, metadata)``.
    The signature read is ``fn``'s own (a wrapper's, not the function it wraps); a callable
    without one readable is taken as it is."""
    if inspect.iscoroutinefunction(fn):
        raise RewardConfigError(
            f"reward path {path!r}: {attr} is an async function; a reward is called in a "
            "worker process and must return its float: define it with def, not async def")
    try:
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("completion", {})
    except TypeError:
        raise RewardConfigError(
            f"reward path {path!r}: {attr}{signature} cannot be called as a reward, "
            "fn(completion: str, metadata: dict) -> float"
        ) from None


def reward_path(fn: RewardFn) -> str:
    """The importable ``"module:qualname"`` of ``fn``, used to rebuild it in worker processes."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"reward function {fn!r} cannot be imported by name; define it at module level"
        )
    return f"{module}:{qualname}"
