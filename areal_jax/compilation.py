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
import functools
import hashlib
import logging
import os
import platform
import stat
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_EVENT = _TRACE_EVENTS[-1]
log = logging.getLogger(__name__)
# Recorded (inside the backend event) only when the persistent cache held the program.
_CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


def default_cache_dir() -> Path:
    """``$AREAL_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/areal-jax/xla`` (``~/.cache/...``)."""
    if os.environ.get("AREAL_JAX_CACHE_DIR"):
        return Path(os.environ["AREAL_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "areal-jax" / "xla"


@functools.cache
def host_key() -> str:
    """The instruction set of this host's CPU, as a directory name: programs compiled for a
    CPU run on that CPU only (JAX's cache keys leave it out), so hosts sharing a cache (a home
    directory on a cluster) keep their programs apart."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    flags = flags or f"{platform.machine()} {platform.processor()}"
    return f"host-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def enable_compilation_cache(directory: str | Path | None = None,
                             exact: bool = False) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``directory`` (default:
    ``default_cache_dir()``), in a subdirectory per CPU instruction set (``host_key``), for
    this process and the processes it starts; ``""`` turns it off. Every program is cached,
    however fast it compiled. A directory that another user owns or every user may write
    (they would choose the machine code this process runs), or that cannot be written, is not
    used: a warning says why and the cache is off. ``exact``: ``directory`` itself, no
    subdirectory (the one another process of the run uses). Returns the directory in use
    (None: off)."""
    import jax

    if directory != "":
        base = (Path(directory) if directory else default_cache_dir()).expanduser().resolve()
        path = base if exact or base.name == host_key() else base / host_key()
        if (why := _unusable_cache(path)) is None:
            settings = {"jax_compilation_cache_dir": str(path),
                        "jax_persistent_cache_min_compile_time_secs": 0.0,
                        "jax_persistent_cache_min_entry_size_bytes": 0}
            for name, value in settings.items():
                jax.config.update(name, value)
                os.environ[name.upper()] = str(value)
            return path
        log.warning("the persistent compilation cache %s is off: %s; every program compiles in "
                    "every run (set compilation_cache_dir to a directory of your own, or '' to "
                    "turn the cache off)", path, why)
    jax.config.update("jax_compilation_cache_dir", None)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = ""  # off for the processes it starts too
    return None


def _unusable_cache(path: Path) -> str | None:
    """Why ``path`` may not hold this process's compiled programs, or None (it is then
    created, owned by this user, not writable by every user, and its damaged entries are
    removed: ``_remove_damaged_entries``)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in (path, path.parent):
            st = directory.stat()
            if not stat.S_ISDIR(st.st_mode):
                return f"{directory} is not a directory"
            if st.st_uid not in (os.geteuid(), 0) or (directory == path and
                                                      st.st_uid != os.geteuid()):
                return f"{directory} belongs to another user (uid {st.st_uid})"
            # Group-writable passes: with umask 002 a user's own directories are, for the
            # user's private group.
            if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
                return f"any user may write to {directory} (mode {stat.S_IMODE(st.st_mode):o})"
        with tempfile.TemporaryFile(dir=path):
            pass
        _remove_damaged_entries(path)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


# Entries older than this file's modification time were read whole and found intact.
_CHECKED_STAMP = ".areal-jax-checked"
# An entry modified this recently may still be being written: it is checked by a later start.
SETTLED_S = 60.0


def _remove_damaged_entries(path: Path) -> None:
    """Remove the cache entries a write left cut short (a process killed in the write, a full
    disk): JAX reads such an entry, warns, compiles the program again and never replaces it,
    in every later run. Empty entries go whatever their age; the others are checked by
    decompressing them (``_intact``), once each: those written since the previous check and
    settled."""
    stamp = path / _CHECKED_STAMP
    since = stamp.stat().st_mtime if stamp.is_file() else 0.0
    settled = time.time() - SETTLED_S
    removed = []
    for entry in path.iterdir():
        try:
            st = entry.stat()
        except FileNotFoundError:  # removed meanwhile (another process's check)
            continue
        if not (entry.name.endswith("-cache") and stat.S_ISREG(st.st_mode)):
            continue
        if st.st_size == 0 or (since <= st.st_mtime < settled and _intact(entry) is False):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    stamp.touch()
    os.utime(stamp, (settled, settled))
    if removed:
        log.warning("removed %d damaged entries of the compilation cache %s (writes cut short; "
                    "their programs compile again once): %s", len(removed), path,
                    ", ".join(sorted(removed)[:3]) + (", ..." if len(removed) > 3 else ""))


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _intact(entry: Path) -> bool | None:
    """Whether the cache entry ``entry`` decompresses whole, by the codec its first bytes name
    (JAX writes zstd where Python has it, else zlib, and JAX installs sharing a cache may
    differ); None where this process cannot tell (no zstd here, or the entry unreadable)."""
    try:
        data = entry.read_bytes()
    except OSError:
        return None
    if data.startswith(_ZSTD_MAGIC):
        try:
            from compression import zstd  # Python 3.14
            decompress, error = zstd.decompress, zstd.ZstdError
        except ImportError:
            try:
                import zstandard
            except ImportError:
                return None
            decompress, error = zstandard.ZstdDecompressor().decompress, zstandard.ZstdError
    else:
        decompress, error = zlib.decompress, zlib.error
    try:
        decompress(data)
    except error:
        return False
    except MemoryError:  # a damaged zstd header may claim any size: not told here
        return None
    return True


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
