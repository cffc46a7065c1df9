"""Generation engines, built by kind: ``create_engine(config)``.

Each kind lives in its own module, imported only when selected, which exposes
``build_engine(config: EngineConfig) -> GenerationEngine`` and ``OPTIONS``, the dataclass of
its ``engine.options``; ``OPTIONS.served_context(positions)`` is the longest prompt + output it
serves for a model of that many positions (``OPTIONS.context_option`` names the option that
sets it).
"""

from __future__ import annotations

import importlib
from typing import Any

from areal_jax.config import ConfigError, from_dict
from rollout.config import EngineConfig
from rollout.engine import GenerationEngine

ENGINE_MODULES = {
    "jax": "rollout.engines.jax_engine",
    "sglang": "rollout.engines.sglang_engine",
}


def create_engine(config: EngineConfig) -> GenerationEngine:
    """The engine of kind ``config.kind``; a clear ``ConfigError`` if it is unavailable."""
    module_name, module = _engine_module(config.kind)
    build = getattr(module, "build_engine", None)
    if build is None:
        raise ConfigError(f"engine.kind: {module_name} does not define build_engine(config)")
    engine = build(config)
    if not isinstance(engine, GenerationEngine):
        raise TypeError(f"{module_name}.build_engine returned {type(engine).__name__}")
    return engine


def check_engine_options(config: EngineConfig) -> Any:
    """``config.options`` as the engine's ``OPTIONS``, without building the engine: the
    ``ConfigError`` (naming the key) it would raise is found before a run's long work."""
    return from_dict(_engine_module(config.kind)[1].OPTIONS, config.options,
                     prefix="engine.options")


def _engine_module(kind: str):
    """(module name, module) of the engine ``kind``; a clear ``ConfigError`` if unavailable."""
    module_name = ENGINE_MODULES.get(kind)
    if module_name is None:
        raise ConfigError(f"engine.kind: {kind!r} is not one of {sorted(ENGINE_MODULES)}")
    try:
        return module_name, importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ConfigError(
            f"engine.kind: {kind!r} needs the module {module_name}, which is not available"
        ) from e
