"""Compilation: the persistent cache (on by default) and the compile time spent per step.

XLA programs compiled once are stored on disk and reused by later runs, by the rollout servers
a run launches (they inherit the environment) and by the test suite, so a restarted or repeated
run does not pay compilation again. ``CompileMeter`` reports how much time a step spent
compiling, so a late recompile shows up in the metrics instead of as an unexplained slow step,
and tells programs compiled from programs loaded from the persistent cache (compiled earlier,
or ahead by another process); compilation on a thread marked ``compiling_ahead()`` (off the
critical path) is counted apart.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_EVENT = _TRACE_EVENTS[-1]
# Recorded (inside the backend event) only when the persistent cache held the program.
_CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


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


_thread_state = threading.local()


@contextlib.contextmanager
def compiling_ahead() -> Iterator[None]:
    """Mark compilation on this thread as ahead of need (``CompileMeter.take_ahead``)."""
    _thread_state.ahead = True
    try:
        yield
    finally:
        _thread_state.ahead = False


class Compiled(NamedTuple):
    """Compilation since the previous take: seconds spent tracing, lowering and compiling or
    loading programs; programs compiled; programs loaded from the persistent cache."""

    seconds: float
    programs: int
    loaded: int


class CompileMeter:
    """Compilation in this process since the previous ``take()`` (``Compiled``): on the
    threads that need the programs (``take``) and on threads compiling ahead
    (``take_ahead``)."""

    _lock = threading.Lock()
    # compiled ahead? -> [seconds, programs compiled or loaded, programs loaded]
    _totals = {False: [0.0, 0, 0], True: [0.0, 0, 0]}
    _registered = False

    def __init__(self):
        import jax

        cls = type(self)
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True
            self._seen = {ahead: tuple(total) for ahead, total in cls._totals.items()}

    @classmethod
    def _on_event(cls, event: str, duration: float, **_) -> None:
        if event == _CACHE_LOAD_EVENT:  # inside this thread's backend event, which follows
            _thread_state.loaded = True
        elif event in _TRACE_EVENTS:
            backend = event == _BACKEND_EVENT
            loaded = backend and getattr(_thread_state, "loaded", False)
            if backend:
                _thread_state.loaded = False
            with cls._lock:  # a program and whether it was loaded count together
                total = cls._totals[getattr(_thread_state, "ahead", False)]
                total[0] += duration
                total[1] += backend
                total[2] += loaded

    @classmethod
    def add_ahead(cls, seconds: float) -> None:
        """Count ``seconds`` compiled ahead elsewhere (in a helper process) as this process's
        own compiling ahead (not as programs: those count as loaded where a step loads them from
        the cache)."""
        with cls._lock:
            cls._totals[True][0] += seconds

    def take(self) -> Compiled:
        """Compilation where the programs were needed, since the previous ``take``."""
        return self._take(ahead=False)

    def take_ahead(self) -> Compiled:
        """Compilation ahead of need, since the previous ``take_ahead``."""
        return self._take(ahead=True)

    def _take(self, ahead: bool) -> Compiled:
        with self._lock:
            now = tuple(self._totals[ahead])
        seen, self._seen[ahead] = self._seen[ahead], now
        loaded = now[2] - seen[2]
        return Compiled(now[0] - seen[0], now[1] - seen[1] - loaded, loaded)
