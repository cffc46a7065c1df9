"""Compilation: the persistent cache (on by default) and the compile time spent per step.

XLA programs compiled once are stored on disk and reused by later runs, by the rollout servers
a run launches (they inherit the environment) and by the test suite, so a restarted or repeated
run does not pay compilation again. ``CompileMeter`` reports how much time a step spent
compiling, so a late recompile shows up in the metrics instead of as an unexplained slow step.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_EVENT = _TRACE_EVENTS[-1]


def default_cache_dir() -> Path:
    """``$AREAL_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/areal-jax/xla`` (``~/.cache/...``)."""
    if os.environ.get("AREAL_JAX_CACHE_DIR"):
        return Path(os.environ["AREAL_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "areal-jax" / "xla"


def enable_compilation_cache(directory: str | Path | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``directory`` (default:
    ``default_cache_dir()``) for this process and the processes it starts; ``""`` turns it off.
    Every program is cached, however fast it compiled. Returns the directory in use."""
    import jax

    if directory == "":
        jax.config.update("jax_compilation_cache_dir", None)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return None
    path = Path(directory) if directory else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(path),
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    return path


class CompileMeter:
    """Seconds spent tracing, lowering and compiling, and programs compiled, in this process
    since the previous ``take()``."""

    _lock = threading.Lock()
    _seconds = 0.0
    _programs = 0
    _registered = False

    def __init__(self):
        import jax

        cls = type(self)
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True
            self._seen = (cls._seconds, cls._programs)

    @classmethod
    def _on_event(cls, event: str, duration: float, **_) -> None:
        if event in _TRACE_EVENTS:
            with cls._lock:
                cls._seconds += duration
                cls._programs += event == _BACKEND_EVENT

    def take(self) -> tuple[float, int]:
        cls = type(self)
        with cls._lock:
            now = (cls._seconds, cls._programs)
        seconds, programs = now[0] - self._seen[0], now[1] - self._seen[1]
        self._seen = now
        return seconds, programs
