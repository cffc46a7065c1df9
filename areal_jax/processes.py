"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``).

A multithreaded parent (anything that has started JAX, gRPC or an event loop) must not run
Python between ``fork`` and ``exec``: a lock another thread held at the fork stays locked in
the child. ``tied_argv`` therefore starts a command through this module's own launcher
(``python -m areal_jax.processes``), which arms the parent-death signal and pins CPUs after its
exec, in a fresh single-threaded interpreter, and then execs the command itself.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_EXEC_FAILED = 127  # the shell's code for a command that could not be run


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, for the system calls Python does not wrap (prctl, mount, unshare); load
    it before forking."""
    return ctypes.CDLL(None, use_errno=True)


def process_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (any user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child before exec: receive ``sig`` when the thread that started it ends, even if
    that process was SIGKILLed. Exits at once if this cannot be armed or ``parent`` is already
    gone. Elsewhere than Linux it does nothing."""
    if sys.platform != "linux":
        return
    if not arm_parent_death_signal(sig) or os.getppid() != parent:
        os._exit(1)


def arm_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """``PR_SET_PDEATHSIG`` (Linux): ``sig`` when the thread that started this process ends;
    whether it was armed. Changing credentials disarms it."""
    return libc().prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds areal_jax/


def own_module_argv(module: str, args: list[str]) -> list[str]:
    """argv that runs this project's ``module`` as ``python -m`` would, in a child whatever its
    working directory and ``PYTHONPATH`` hold (a user's own ``rollout.py`` next to their config
    was run instead): without the current directory on the import path (``-P``) and with this
    project's import root first, in that process alone (its environment, which its own children
    inherit, is unchanged)."""
    run = (f"import runpy, sys; sys.path.insert(0, {IMPORT_ROOT!r}); "
           f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-P", "-c", run, *args]


def rollout_shadowed_by() -> str | None:
    """Where another module named ``rollout`` hides this project's server package on this
    process's import path (a user's ``rollout.py`` on ``PYTHONPATH``); None when it does not."""
    import importlib.util

    spec = importlib.util.find_spec("rollout")
    if spec is None:
        return None
    origin = os.path.abspath(spec.origin) if spec.origin else ""
    if origin == os.path.join(IMPORT_ROOT, "rollout", "__init__.py"):
        return None
    return origin or str(list(spec.submodule_search_locations or []))


def child_can_import(module: str) -> bool:
    """Whether a child started with ``own_module_argv`` (``-P``: without the current
    directory on its import path; this project's import root first; this environment, so
    ``PYTHONPATH`` and installed packages) finds the top-level ``module``: asked of such a
    child, since ``.pth`` files, editable installs and ``python -m`` all shape the path."""
    import subprocess

    code = (f"import importlib.util, sys; sys.path.insert(0, {IMPORT_ROOT!r}); "
            f"sys.exit(0 if importlib.util.find_spec({module!r}) else 1)")
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True,
                          timeout=120).returncode == 0


def tied_argv(argv: list[str], sig: int = signal.SIGTERM,
              cpus: list[int] | None = None) -> list[str]:
    """``argv`` started through the launcher: the command receives ``sig`` when the thread that
    calls ``subprocess.Popen`` with the result ends (the process too, even SIGKILLed), and runs
    on ``cpus`` only (None: wherever this process may). Pass it to ``Popen`` without a
    ``preexec_fn``. Elsewhere than Linux, ``argv`` itself, and ``cpus`` is an error."""
    if sys.platform != "linux":
        if cpus:
            raise ValueError(f"pinning a process to CPUs {cpus} needs Linux")
        return list(argv)
    head = [sys.executable, "-m", "areal_jax.processes", "--parent", str(os.getpid()),
            "--signal", str(int(sig))]
    if cpus:
        head += ["--cpus", ",".join(str(c) for c in cpus)]
    return [*head, "--", *argv]


def main(args: list[str] | None = None) -> int:
    """The launcher: arm the parent-death signal, pin CPUs, then exec the command (this process
    becomes it, with the same pid and environment); 127 if it cannot be run or pinned."""
    parser = argparse.ArgumentParser(prog="python -m areal_jax.processes")
    parser.add_argument("--parent", type=int, required=True, help="pid that must be our parent")
    parser.add_argument("--signal", type=int, default=int(signal.SIGTERM))
    parser.add_argument("--cpus", type=lambda s: [int(c) for c in s.split(",")], default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no command to run after --")
    die_with_parent(ns.parent, ns.signal)
    try:
        if ns.cpus:
            os.sched_setaffinity(0, ns.cpus)
    except OSError as e:
        print(f"cannot run {command[0]!r} on CPUs {ns.cpus}: {e}", file=sys.stderr, flush=True)
        return _EXEC_FAILED
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"cannot run {command[0]!r}: {e}", file=sys.stderr, flush=True)
    return _EXEC_FAILED


if __name__ == "__main__":
    sys.exit(main())
