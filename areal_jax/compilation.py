"""Compilation: the persistent cache (on by default) and the compile time spent per step.

XLA programs compiled once are stored on disk and reused by later runs, by the rollout servers
a run launches (they inherit the environment) and by the test suite, so a restarted or repeated
run does not pay compilation again. ``CompileMeter`` reports how much time a step spent
compiling, so a late recompile shows up in the metrics instead of as an unexplained slow step;
compilation on a thread marked ``compiling_ahead()`` (off the critical path) is counted apart.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
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


_thread_state = threading.local()


@contextlib.contextmanager
def compiling_ahead() -> Iterator[None]:
    """Mark compilation on this thread as ahead of need (``CompileMeter.take_ahead``)."""
    _thread_state.ahead = True
    try:
        yield
    finally:
        _thread_state.ahead = False


class CompileMeter:
    """Seconds spent tracing, lowering and compiling, and programs compiled, in this process
    since the previous ``take()``: on the threads that need the programs (``take``) and on
    threads compiling ahead (``take_ahead``)."""

    _lock = threading.Lock()
    _totals = {False: [0.0, 0], True: [0.0, 0]}  # compiled ahead? -> [seconds, programs]
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
        if event in _TRACE_EVENTS:
            with cls._lock:
                total = cls._totals[getattr(_thread_state, "ahead", False)]
                total[0] += duration
                total[1] += event == _BACKEND_EVENT

    @classmethod
    def add_ahead(cls, seconds: float) -> None:
        """Count ``seconds`` compiled ahead elsewhere (in a helper process) as this process's
        own compiling ahead (not as programs: those count where they load from the cache)."""
        with cls._lock:
            cls._totals[True][0] += seconds

    def take(self) -> tuple[float, int]:
        """(seconds, programs) compiled where they were needed, since the previous ``take``."""
        return self._take(ahead=False)

    def take_ahead(self) -> tuple[float, int]:
        """(seconds, programs) compiled ahead of need, since the previous ``take_ahead``."""
        return self._take(ahead=True)

    def _take(self, ahead: bool) -> tuple[float, int]:
        with self._lock:
            now = tuple(self._totals[ahead])
        seen, self._seen[ahead] = self._seen[ahead], now
        return now[0] - seen[0], now[1] - seen[1]
