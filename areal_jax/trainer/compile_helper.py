"""A compile helper: a child process that compiles the trainer's programs ahead of need.

On a CPU backend a compile takes the CPUs the steps run on, and XLA compiles on threads at the
process's priority, so a background thread cannot compile without slowing the steps beside it.
A separate process can: it runs wholly at the lowest CPU priority (nice ``NICE``), on every CPU
of the machine, so it compiles on CPU time nobody else wants (an idle rollout server's cores,
the trainer's own while it waits) and yields at once to any other work. It builds the trainer's
programs from shapes alone (``ProgramSpec``), compiles them into the persistent compilation
cache, and the trainer's step then loads them from the cache instead of compiling (measured on
the 2-core CPU: 1.4 s instead of 16 s for one micro-batch shape of the long-tail benchmark).

One helper serves every trainer of a process (``shared_helper``), one request at a time, and
keeps the programs of the last ``_KEEP_SPECS`` trainers it compiled for. It exits when its
parent process ends (it checks twice a second) or its input closes. Messages are pickles on its
stdin and stdout, between this process and its own child.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Hashable
from pathlib import Path

from areal_jax.trainer.programs import ProgramSpec

NICE = 19  # the helper's nice value: the lowest CPU priority
_KEEP_SPECS = 2  # trainers whose programs the helper keeps built

# Run by ``python -c``: lower the priority before anything heavy is imported.
_BOOT = (f"import os; os.setpriority(os.PRIO_PROCESS, 0, {NICE}); "
         "from areal_jax.trainer.compile_helper import main; raise SystemExit(main())")


class HelperGone(RuntimeError):
    """The helper process did not start or has ended; the message says why."""


class HelperJobError(RuntimeError):
    """The helper could not compile one key (the traceback is in the message)."""


class CompileHelper:
    """Parent side: starts the helper on first use and compiles keys in it, one at a time.

    ``cache_dir``: the persistent compilation cache both processes use. ``log_path``: where the
    helper's own output goes (None: nowhere).
    """

    def __init__(self, cache_dir: str | Path, log_path: str | Path | None = None):
        self._cache_dir = str(cache_dir)
        self._log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The helper's process id, once started."""
        return self._proc.pid if self._proc is not None else None

    def compile(self, spec: ProgramSpec, key: Hashable) -> float:
        """Compile the programs of ``key`` (``TrainPrograms.compile``) of the trainer ``spec``
        describes, in the helper; returns the seconds it took there.

        Raises ``HelperJobError`` if the helper could not compile them, ``HelperGone`` if the
        helper did not start, has ended (it is not restarted) or cannot build that trainer's
        programs.
        """
        with self._lock:
            proc = self._started()
            kind, value = self._exchange(proc, (spec, key))
        if kind == "unbuildable":
            raise HelperGone(f"the compile helper cannot build the trainer's programs:\n{value}")
        if kind == "failed":
            raise HelperJobError(value)
        return float(value)

    def close(self) -> None:
        """End the helper: close its input, then kill it if it has not exited within 5 s (a
        compile cannot be interrupted, and its result is no longer wanted)."""
        self._closed = True
        proc = self._proc  # not under the lock: a request may hold it for a whole compile
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def _started(self) -> subprocess.Popen:
        """The helper process, started and greeted on first use (under ``_lock``)."""
        if self._closed:
            raise HelperGone("the compile helper was closed")
        if self._proc is not None:
            return self._proc
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        except OSError as e:
            raise HelperGone(f"the compile helper could not start: {e}") from e
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        kind, value = self._exchange(self._proc, {"parent": os.getpid(),
                                                  "cache_dir": self._cache_dir})
        if kind != "ready":
            raise HelperGone(f"the compile helper could not start:\n{value}")
        return self._proc

    def _exchange(self, proc: subprocess.Popen, message) -> tuple[str, object]:
        """Send ``message``, return the reply; HelperGone if the pipe is closed."""
        try:
            pickle.dump(message, proc.stdin)
            proc.stdin.flush()
            return pickle.load(proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as e:
            code = proc.poll()
            where = f"; its log: {self._log_path}" if self._log_path else ""
            raise HelperGone(f"the compile helper ended (exit code {code}){where}") from e


_shared: dict[str, CompileHelper] = {}
_shared_lock = threading.Lock()


def shared_helper(cache_dir: str | Path, log_path: str | Path | None = None) -> CompileHelper:
    """This process's helper for ``cache_dir`` (created on first call, with ``log_path``; it
    ends when this process exits)."""
    with _shared_lock:
        helper = _shared.get(str(cache_dir))
        if helper is None:
            helper = _shared[str(cache_dir)] = CompileHelper(cache_dir, log_path)
            atexit.register(helper.close)
        return helper


def main() -> int:
    """Child side (started by ``CompileHelper``): compile the (spec, key) requests read from
    stdin, replying on stdout, until stdin closes or the parent ends."""
    reply_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout goes to the log, not into the replies
    read_from = sys.stdin.buffer

    def reply(kind: str, value: object) -> None:
        pickle.dump((kind, value), reply_to)
        reply_to.flush()

    try:
        hello = pickle.load(read_from)
    except EOFError:
        return 0
    _exit_with(hello["parent"])
    _use_every_cpu()
    try:
        from areal_jax.compilation import enable_compilation_cache

        enable_compilation_cache(hello["cache_dir"], exact=True)  # the trainer's own
    except Exception:  # noqa: BLE001 - reported to the parent, which compiles without us
        reply("error", traceback.format_exc())
        return 1
    reply("ready", None)
    built: dict[bytes, object] = {}  # pickled spec -> its TrainPrograms, oldest first
    while True:
        try:
            spec, key = pickle.load(read_from)
        except EOFError:
            return 0
        began = time.monotonic()
        name = pickle.dumps(spec)
        try:
            programs = built.pop(name, None) or spec.programs()
        except Exception:  # noqa: BLE001 - that trainer compiles without us
            reply("unbuildable", traceback.format_exc())
            continue
        built[name] = programs
        while len(built) > _KEEP_SPECS:
            built.pop(next(iter(built)))
        try:
            programs.compile(key)
        except Exception:  # noqa: BLE001 - that key compiles in the trainer's step instead
            reply("failed", traceback.format_exc())
        else:
            reply("done", time.monotonic() - began)


def _exit_with(parent: int) -> None:
    """Exit as soon as ``parent`` is no longer this process's parent (it ended, even killed),
    checked twice a second on a thread of its own."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _use_every_cpu() -> None:
    """Run on any CPU the system lets this process use (not only the trainer's, which it
    inherited): at the lowest priority it takes only time the others leave idle."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            pass  # keep the inherited CPUs
