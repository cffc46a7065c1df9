"""Run untrusted, model-written Python in a subprocess with resource, filesystem and network limits.

What :func:`run_python` enforces (docs/rewards.md lists what it does not):

- ``resource`` limits in the child: RLIMIT_CPU (CPU seconds per process), RLIMIT_AS (address
  space), RLIMIT_NPROC (processes), RLIMIT_FSIZE (largest file written, stdout/stderr included),
  RLIMIT_NOFILE (open files), RLIMIT_CORE = 0; and a seccomp filter (``_syscall_filter``)
  refusing the calls that hold memory RLIMIT_AS does not count (``memory_files_refused``).
- A fresh private temporary directory as working directory, removed afterwards.
- As root with mount namespaces: a filesystem jail (``_jail``) in which only the system
  directories, the interpreter and that working directory exist, so the code cannot read the
  caller's files (run directory, datasets). ``SandboxResult.fs_isolated`` says whether it was on.
- An emptied environment (only a minimal ``PATH``) and ``python -I -B`` (isolated mode).
- A new session and process group; on a wall-clock timeout, and always once the main process
  ends, every process of the group (and of the sandbox's own uid, below) is killed. The main
  process is also killed when the process that started it dies (``PR_SET_PDEATHSIG``).
- When running as root, the code runs under a uid of its own (``UID_BASE + pid``), so the
  process limit counts only its processes, it cannot write the caller's files, and no process
  that escaped the group survives. As another user the process limit is the user's current
  process count plus ``max_processes``.
- Each run's directories live under a scratch root (:func:`set_scratch_root`) together with a
  record of its process group and uid, so a supervisor that kills the calling process can kill
  what it left running and delete its files with :func:`reap_scratch_root`.
- A new, empty network namespace (``unshare(CLONE_NEWNET)``; for non-root users together with a
  new user namespace) when the kernel allows it; ``SandboxResult.network_isolated`` says whether
  it was in effect.
- A new IPC namespace (``CLONE_NEWIPC``) with it when the kernel allows: System V shared memory
  the code creates and detaches (which no address-space limit counts) goes with the run's last
  process instead of staying on the host; ``SandboxResult.ipc_isolated`` says whether it did.
- A new PID namespace (``CLONE_NEWPID``) with it when the kernel allows: the code runs as its
  first process and can signal no process outside it (without root it runs under the caller's
  uid, and could otherwise kill the rollout server; outside the jail the host's ``/proc`` still
  lists them, readable as any process's is); when that process ends, the kernel
  kills every process left in the namespace, those that left the process group too. The
  process that waits for it outside (the one the caller started) ends as it ended. As the
  namespace's first process, the code's main process ignores the signals it sends itself
  without a handler (and the soft CPU limit's SIGXCPU: the hard one's SIGKILL ends it).
  ``SandboxResult.pid_isolated`` says whether it was in effect.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from areal_jax.processes import arm_parent_death_signal, die_with_parent, libc
from areal_jax.rewards import _jail, _syscall_filter

MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
UID_BASE = 2_000_000_000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_RECORD = "pid"  # "<process group> <uid or -1> <start time>", written by the child before it runs code
_scratch_root: str | None = None

log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox itself could not start (not a failure of the code run inside it)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits for one sandboxed run; ``cpu_time_s`` defaults to ``ceil(timeout_s) + 1``."""

    timeout_s: float = 10.0
    cpu_time_s: int | None = None
    memory_bytes: int = 1 << 30
    max_processes: int = 16
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    python: str | None = None

    def __post_init__(self):
        for name in (
            "timeout_s",
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}"
                )
        if self.cpu_time_s is not None and self.cpu_time_s <= 0:
            raise ValueError(f"SandboxLimits.cpu_time_s must be positive, got {self.cpu_time_s!r}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_time_s or math.ceil(self.timeout_s) + 1


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. ``returncode`` is negative (``-signal``) when a signal killed it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float
    network_isolated: bool
    uid_isolated: bool
    fs_isolated: bool
    ipc_isolated: bool
    pid_isolated: bool
    memory_files_refused: bool  # the seccomp filter of ``_syscall_filter`` was in effect

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclasses.dataclass(frozen=True)
class _Isolation:
    as_root: bool
    unshare_flags: int  # 0 when no namespace could be created
    memory_files_refused: bool = False  # the system-call filter installs here

    @property
    def jail(self) -> bool:
        return self.as_root and bool(self.unshare_flags & _CLONE_NEWNS)


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``source`` as ``main.py`` with ``stdin`` under ``limits``; never raises for bad code."""
    limits = limits or SandboxLimits()
    iso = _isolation()
    python = limits.python or _default_python(iso.as_root)
    nproc = limits.max_processes
    if not iso.as_root:  # the uid's own processes count, and the waiter outside a PID namespace
        nproc += _own_process_count() + bool(iso.unshare_flags & _CLONE_NEWPID)
    run_dir = tempfile.mkdtemp(prefix="areal-sandbox-", dir=_scratch_root)
    try:
        os.chmod(run_dir, 0o711)  # the sandbox uid may reach work/, not list or read the rest
        workdir, io_dir, jail = (os.path.join(run_dir, d) for d in ("work", "io", "jail"))
        for d in (workdir, io_dir, jail):
            os.mkdir(d, 0o700)
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
        stdin_path = os.path.join(io_dir, "stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        with (
            open(stdin_path, "rb") as fin,
            open(os.path.join(io_dir, "stdout"), "w+b") as fout,
            open(os.path.join(io_dir, "stderr"), "w+b") as ferr,
        ):
            setup = functools.partial(
                _child_setup, limits, nproc, iso, os.path.join(run_dir, _RECORD), os.getpid(),
                (jail, workdir, _jail.read_only_paths(python)) if iso.jail else None,
            )
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    [python, "-I", "-B", "main.py"],
                    cwd=workdir,
                    env={"PATH": MINIMAL_PATH},
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    start_new_session=True,
                    preexec_fn=setup,
                    close_fds=True,
                )
            except (OSError, subprocess.SubprocessError) as e:
                raise SandboxError(f"cannot start {python} in the sandbox: {e}") from e
            with contextlib.suppress(OSError):  # the code reads its stdin once, by its fd
                os.unlink(stdin_path)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_tree(proc.pid, _sandbox_uid(iso, proc.pid))
                proc.wait()
                _reap_strays(proc.pid, _sandbox_uid(iso, proc.pid))
            elapsed = time.monotonic() - start
            stdout = _read(fout, limits.max_file_bytes)
            stderr = _read(ferr, limits.max_file_bytes)
    finally:
        _remove_tree(run_dir)
    return SandboxResult(
        returncode=proc.returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        elapsed_s=elapsed,
        network_isolated=bool(iso.unshare_flags & _CLONE_NEWNET),
        uid_isolated=iso.as_root,
        fs_isolated=iso.jail,
        ipc_isolated=bool(iso.unshare_flags & _CLONE_NEWIPC),
        pid_isolated=bool(iso.unshare_flags & _CLONE_NEWPID),
        memory_files_refused=iso.memory_files_refused,
    )


def set_scratch_root(path: str | None) -> None:
    """Create the directories of this process's later runs under ``path`` (None: the temp dir).

    Give each process that runs sandboxes its own root; after killing such a process, call
    :func:`reap_scratch_root` on it.
    """
    global _scratch_root
    _scratch_root = path


def reap_scratch_root(path: str) -> None:
    """Kill every sandboxed process recorded under ``path``, then delete ``path``.

    For a supervisor whose sandbox-running process was killed mid-run: the runs it left behind
    (own session, own uid) and their directories would otherwise survive. Only what this user
    wrote counts (``path``, each run directory and its record owned by it, not writable by
    others), and a record whose process group's number another process has since taken (its
    leader running with another start time) kills nothing.
    """
    if not owned_private_directory(path):
        return
    for name in os.listdir(path):
        record = _read_record(os.path.join(path, name))
        if record is not None:
            _kill_recorded(*record)
    _remove_tree(path)


def owned_private_directory(path: str) -> bool:
    """Whether ``path`` is a directory (not a link) of this user that no one else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _read_record(run_dir: str) -> tuple[int, int | None, int] | None:
    """(process group, sandbox uid or None, the group leader's start time) recorded in
    ``run_dir``; None where there is none (the child never started), or where the directory or
    the record is not this user's or does not read as one of its records."""
    if not owned_private_directory(run_dir):
        return None
    try:
        fd = os.open(os.path.join(run_dir, _RECORD), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            pgid, uid, start = (int(v) for v in f.read(64).split())
        except ValueError:
            return None
    if pgid < 2 or uid not in (-1, UID_BASE + pgid):
        return None
    return pgid, None if uid < 0 else uid, start


def _kill_recorded(pgid: int, uid: int | None, start: int) -> None:
    """Kill what a killed supervisor's run left: as root, every process of its own uid (those
    that left its group too), unless its leader's pid now leads a live run of that same uid;
    else this user's processes in its process group, unless the group's number now belongs to
    another process (its leader started at another time)."""
    leader = _start_time(pgid)
    taken = leader is not None and leader != start
    if uid is not None:
        if not (taken and _real_uid(pgid) == uid):
            _kill_all(lambda group, owner: owner == uid)
    elif not taken:
        me = os.getuid()
        _kill_all(lambda group, owner: group == pgid and owner == me)


def _real_uid(pid: int | str) -> int | None:
    """The real uid process ``pid`` runs as (from ``status``, not the owner of ``/proc/PID``,
    which a process can turn into root by making itself non-dumpable), or None where it is
    gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return int(next(line for line in f if line.startswith(b"Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first, so field N of
    proc(5) is at N - 3), or None where the process is gone (``pid``: also ``PID/task/TID``,
    one thread's)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None where it is gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def filesystem_isolation_available() -> bool:
    """Whether runs get the filesystem jail on this machine, as this user (root only)."""
    return _isolation().jail


def _sandbox_uid(iso: _Isolation, pid: int) -> int | None:
    return UID_BASE + pid if iso.as_root else None


def network_isolation_available() -> bool:
    """Whether runs get their own empty network namespace on this machine, as this user."""
    return bool(_isolation().unshare_flags & _CLONE_NEWNET)


def pid_isolation_available() -> bool:
    """Whether runs get their own PID namespace on this machine, as this user."""
    return bool(_isolation().unshare_flags & _CLONE_NEWPID)


def _child_setup(
    limits: SandboxLimits,
    nproc: int,
    iso: _Isolation,
    record: str,
    parent: int,
    jail: tuple[str, str, tuple[str, ...]] | None,
) -> None:
    """Runs in the forked child before exec (as the caller's user), in this order: record the
    process group and uid for the reaper, isolate, limit, drop to the sandbox uid, die with the
    parent (in a PID namespace: with the process waiting outside it)."""
    uid = _sandbox_uid(iso, os.getpid())
    with open(record + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {-1 if uid is None else uid} {_start_time(os.getpid())}\n")
    os.rename(record + ".tmp", record)
    outside = None  # in a PID namespace: a descriptor that reads end of file once the
    # process waiting outside it is gone
    if iso.as_root and iso.unshare_flags:
        outside = _isolate(iso.unshare_flags, parent)
    if jail is not None:
        jail_dir, workdir, read_only = jail
        _jail.enter(jail_dir, workdir, read_only, limits.max_file_bytes)
    cpu = limits.cpu_seconds
    for which, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)
    if uid is not None:
        os.chown(".", uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif iso.unshare_flags:
        outside = _isolate(iso.unshare_flags, parent)
    # after the isolation, which opens a pipe with the caller's descriptors still open
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    # last: changing credentials clears the parent-death signal
    if outside is None:
        die_with_parent(parent)
    else:
        _die_with_the_waiter(outside)
    if iso.memory_files_refused:
        _refuse_memory_files()


def _refuse_memory_files() -> None:
    """Install ``_syscall_filter`` (memory no address-space limit counts) or raise."""
    if not _syscall_filter.install(libc()):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot install the sandbox's system-call filter: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    if libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _isolate(flags: int, parent: int | None) -> int | None:
    """Enter new namespaces (``flags``); with a PID namespace, go on as its first process
    (``_enter_pid_namespace``) and return its descriptor for ``_die_with_the_waiter``."""
    _unshare(flags)
    return _enter_pid_namespace(parent) if flags & _CLONE_NEWPID else None


def _enter_pid_namespace(parent: int | None) -> int:
    """After ``unshare(CLONE_NEWPID)``, whose namespace only this process's children join: fork
    the namespace's first process, which returns (to exec the code) the read end of a pipe
    whose write end only the process outside holds. The process outside waits for it, holding
    no other descriptor (the caller's ``Popen`` returns once the code has exec'd), dies with
    ``parent`` where given, and ends as the code's process ended."""
    waiting, held = os.pipe()
    first = os.fork()
    if first == 0:
        os.close(held)
        return waiting
    try:
        if parent is not None:
            die_with_parent(parent)
        for fd in os.listdir("/proc/self/fd"):  # those open, not every number up to the limit
            if int(fd) != held:  # (without close_range, a loop of a billion close calls)
                with contextlib.suppress(OSError):  # the listing's own, closed by now
                    os.close(int(fd))
        status = os.waitpid(first, 0)[1]
        if os.WIFSIGNALED(status):  # end by the same signal, for the caller's returncode,
            sig = os.WTERMSIG(status)  # without a core dump of this copy of the caller
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its action
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
    finally:
        os._exit(1)


def _die_with_the_waiter(waiting: int) -> None:
    """In a PID namespace's first process: receive SIGKILL when the process waiting outside
    ends (its parent pid reads 0 here, so ``die_with_parent``'s check cannot tell); exit at
    once where it has ended already (its end of the pipe closed)."""
    if not arm_parent_death_signal():
        os._exit(1)
    os.set_blocking(waiting, False)
    try:
        gone = os.read(waiting, 1) == b""
    except BlockingIOError:
        gone = False
    os.close(waiting)
    if gone:
        os._exit(1)


@functools.cache
def _isolation() -> _Isolation:
    """Probe once per process which namespaces (and, as root, whether the jail) work here: the
    network namespace (with the mount namespace and the jail as root, with a user namespace
    otherwise), then whether an IPC and a PID namespace can be added to it; and whether the
    system-call filter installs."""
    as_root = os.geteuid() == 0
    if sys.platform != "linux":
        return _Isolation(as_root, 0)
    libc()  # load before forking
    _syscall_filter.prepare()
    refused = _probe(lambda _: _refuse_memory_files())

    def works(flags: int, jail: bool) -> bool:
        if jail:
            return _probe(functools.partial(_probe_jail, flags))
        return _probe(lambda _: _isolate(flags, None))

    bases = [(_CLONE_NEWNET | _CLONE_NEWNS, True)] if as_root else []
    bases.append((_CLONE_NEWNET | (0 if as_root else _CLONE_NEWUSER), False))
    for flags, jail in bases:
        if works(flags, jail):
            for extra in (_CLONE_NEWIPC, _CLONE_NEWPID):
                if works(flags | extra, jail):
                    flags |= extra
            return _Isolation(as_root, flags, refused)
    return _Isolation(as_root, 0, refused)


PROBE_TRIES = 2  # a failed probe is tried again before this process goes without that isolation


def _probe(setup: Callable[[str], None]) -> bool:
    """Whether this interpreter starts after ``setup(scratch dir)`` ran in the child, in one of
    ``PROBE_TRIES`` tries: the answer holds for the process's life, and one probe of the jail
    with the IPC namespace was once seen to fail on a loaded machine."""
    for _ in range(PROBE_TRIES):
        with tempfile.TemporaryDirectory(prefix="areal-sandbox-probe-") as d:
            try:
                subprocess.run(
                    [sys.executable, "-I", "-c", ""],
                    cwd=d,
                    preexec_fn=functools.partial(setup, d),
                    env={"PATH": MINIMAL_PATH},
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
                return True
            except subprocess.TimeoutExpired:  # not a refusal: something is wrong here
                log.warning("a probe of the sandbox's isolation did not finish in 30 s; "
                            "without another try that succeeds, runs go without it")
            except (OSError, subprocess.SubprocessError):
                continue
    return False


def _probe_jail(flags: int, scratch: str) -> None:
    _isolate(flags, None)
    jail, work = os.path.join(scratch, "jail"), os.path.join(scratch, "work")
    os.mkdir(jail)
    os.mkdir(work)
    _jail.enter(jail, work, _jail.read_only_paths(sys.executable), 1 << 20)


def _default_python(as_root: bool) -> str:
    """This interpreter, or (when dropping to another uid) one that any user may execute."""
    if not as_root or _world_executable(sys.executable):
        return sys.executable
    for name in ("python3", "python"):
        found = shutil.which(name, path=MINIMAL_PATH)
        if found and _world_executable(found):
            return found
    raise SandboxError(
        f"{sys.executable} is not executable by other users and no system python3 was found; "
        "set SandboxLimits.python to an interpreter every user may run"
    )


def _world_executable(path: str) -> bool:
    real = os.path.realpath(path)
    if not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def _proc_entries():
    """(pid, state, process group, real uid, parent pid) of every process, from /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        fields, uid = _stat_fields(name), _real_uid(name)
        if fields is not None and uid is not None:
            yield int(name), fields[0].decode(), int(fields[2]), uid, int(fields[1])


def _own_process_count() -> int:
    uid = os.getuid()
    return sum(1 for _, _, _, owner, _ in _proc_entries() if owner == uid)


def _kill_tree(pgid: int, uid: int | None) -> None:
    """SIGKILL process group ``pgid`` and every process of ``uid`` until none is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if uid is not None:
        _kill_as(uid)
    _kill_all(lambda group, owner: group == pgid or (uid is not None and owner == uid))


def _reap_strays(pgid: int, uid: int | None) -> None:
    """Reap the dead processes the sandboxed code made this process's children (``clone`` with
    ``CLONE_PARENT``): those of its process group, or, as root, of its uid. Left, each would
    hold a pid for as long as this process lives."""
    me = os.getpid()
    for pid, _, group, owner, parent in _proc_entries():
        if parent == me and (group == pgid or owner == uid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _kill_as(uid: int) -> None:
    """``kill(-1, SIGKILL)`` as ``uid``: the kernel signals every process of that uid at once,
    and a fork in progress fails, where a scan of /proc can miss a process that forks and
    exits again and again (its pid keeps moving)."""
    kill = shutil.which("kill", path=MINIMAL_PATH)
    command = [kill, "-9", "-1"] if kill else [sys.executable, "-I", "-c",
                                                 "import os; os.kill(-1, 9)"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(command, user=uid, group=uid, extra_groups=[], env={"PATH": MINIMAL_PATH},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=10)


def _kill_all(chosen: Callable[[int, int], bool]) -> None:
    """SIGKILL every process ``chosen(process group, uid)`` picks until none is left. A
    process whose main thread exited shows as a zombie while its other threads run on: it
    counts as alive until every thread has ended."""
    for _ in range(200):
        alive = [pid for pid, state, group, owner, _ in _proc_entries()
                 if chosen(group, owner) and (state not in ("Z", "X") or _threads_run(pid))]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    log.warning("sandboxed processes still alive after 200 rounds of SIGKILL: %s", alive)


def _threads_run(pid: int) -> bool:
    """Whether a thread of process ``pid`` is neither dead nor a zombie."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any((fields := _stat_fields(f"{pid}/task/{tid}")) is not None
               and fields[0] not in (b"Z", b"X") for tid in tasks)


def _read(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


_REMOVE_ATTEMPTS = 3  # rmtree passes over a tree that another process is also deleting


def _remove_tree(path: str) -> None:
    """Delete the work directory even where the sandboxed code removed its own permissions.

    Another process may delete parts of the tree at the same time (a reaper and the run's
    surviving supervisor, ``reap_scratch_root``): entries that vanish meanwhile are not an
    error, and a pass they interrupt is retried, at most ``_REMOVE_ATTEMPTS`` passes in all;
    a tree still there after them is left, with a warning.
    """
    if os.geteuid() != 0:  # root removes any tree as it is (and a path-based chmod as root
        # races a sandboxed process swapping a directory for a link to a host directory)
        with contextlib.suppress(OSError, RecursionError):  # a tree too deep: rm's turn below
            for root, dirs, _ in os.walk(path):
                for d in dirs:
                    full = os.path.join(root, d)
                    if not os.path.islink(full):
                        with contextlib.suppress(FileNotFoundError):
                            os.chmod(full, 0o700)
    error: BaseException | None = None
    for _ in range(_REMOVE_ATTEMPTS):
        try:
            shutil.rmtree(path)
            return
        except (OSError, RecursionError) as e:  # what the sandboxed code left may defeat a
            # pass (thousands of nested directories, past Python's recursion and the path
            # length); never raised: a bad completion scores 0, a pool closes, whatever it holds
            if not os.path.lexists(path):
                return
            error = e
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # walks by descriptors
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True,
                       timeout=120)
    if os.path.lexists(path):
        log.warning("could not delete the sandbox directory %s (left in place): %s", path,
                    error)
