"""Score completions in worker processes with a per-call timeout.

Rewards run in separate processes because math-verify relies on ``signal.alarm`` (main thread
only) and model-written code must never run in the caller. A call that times out, crashes its
worker or raises scores 0.0 and is logged; a timed-out or crashed worker is killed and replaced,
so a hung reward never blocks later calls. Each worker runs its sandboxes under a scratch
directory of its own; when a worker is killed, the pool kills the sandboxed processes it left
(own session, own uid) and deletes their files. A pool whose own process was killed (SIGKILL)
cleans nothing; the next pool to start on the machine reaps what it left.

A call's time limit is the pool's ``timeout_s`` plus the reward's own ``time_budget_s(metadata)``
when it declares one (the code rewards: sandbox runs × (per-test timeout + start-up)), so a slow
but correct solution is never cut off by the pool before the sandbox's own limits apply; never
more than ``max_call_s``, since the metadata a budget is computed from may come from a client.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing
import os
import signal
import tempfile

from areal_jax.processes import die_with_parent, process_running
from areal_jax.repeated_warnings import RepeatedWarnings
from areal_jax.rewards.registry import (
    MAX_ABS_REWARD,
    RewardFn,
    RewardNotFoundError,
    available_rewards,
    check_custom,
    get_reward,
    import_path,
    reward_path,
)
from areal_jax.rewards.sandbox import owned_private_directory, reap_scratch_root
from areal_jax.rewards.sandbox import set_scratch_root

logger = logging.getLogger(__name__)


SCRATCH_PREFIX = "areal-reward-worker-"  # then the owning process's pid and a random part


def reap_orphaned_scratch(root: str | None = None) -> list[str]:
    """Reap (``reap_scratch_root``) every worker scratch directory under ``root`` (default: the
    temp dir) whose owning process is gone; returns the directories reaped. Only this user's
    directories are read: what another user puts in a shared temp dir is not a record."""
    root = root or tempfile.gettempdir()
    reaped = []
    for name in os.listdir(root):
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid = name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or process_running(int(pid)) or not owned_private_directory(path):
            continue
        try:
            reap_scratch_root(path)
        except Exception as e:  # noqa: BLE001 - another pool got there first, not ours to
            # remove, or what a sandbox left defeats the removal: a new pool starts all the same
            logger.debug("could not reap %s: %s", path, e)
            continue
        reaped.append(path)
    if reaped:
        logger.warning("reaped %d reward scratch directories of killed processes", len(reaped))
    return reaped


def _worker_main(conn, scratch: str, parent: int | None) -> None:
    """Serve (reward path, completion, metadata) requests with ("ok", float) or ("error", msg).
    Dies with ``parent`` (None: the process that forked it, a fork server), as an idle worker
    does on its pipe's EOF and one inside a reward that hangs would not."""
    die_with_parent(os.getppid() if parent is None else parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_scratch_root(scratch)
    functions = {}
    while True:
        try:
            path, completion, metadata = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if path not in functions:
                functions[path] = import_path(path)
            reply = ("ok", _reward_value(functions[path](completion, metadata)))
        except KeyError as e:  # the typical mistake: a key the dataset does not map
            keys = ", ".join(sorted(metadata)[:20]) or "none"
            reply = ("error", f"KeyError: {e} (metadata keys: {keys})")
        except (Exception, SystemExit) as e:  # a failing reward (sys.exit() too) must not
            # take the worker down
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


def _reward_value(result) -> float:
    """``result`` as a reward: a finite real number within ``MAX_ABS_REWARD`` (else an error
    saying what it was)."""
    if result is None:
        raise TypeError("reward returned None, not a number (a missing return?)")
    if isinstance(result, (str, bytes)):  # float("1.0") would pass a typo's text
        raise TypeError(f"reward returned {type(result).__name__} {result!r}, not a number")
    try:
        value = float(result)
    except (TypeError, ValueError):
        raise TypeError(f"reward returned {type(result).__name__} {result!r:.80}, not a "
                        "number") from None
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value}")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"reward returned {value:g}, beyond ±{MAX_ABS_REWARD:g} (the group's "
                         "advantages would overflow): scale it down")
    return value


class _Worker:
    def __init__(self, ctx):
        self.scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
        os.chmod(self.scratch, 0o711)  # a sandbox uid must reach its own work directory
        self.conn, child = ctx.Pipe()
        # Under forkserver its parent is the fork server, which ends with this process.
        parent = None if ctx.get_start_method() == "forkserver" else os.getpid()
        self.process = ctx.Process(target=_worker_main, args=(child, self.scratch, parent),
                                   daemon=True)
        self.process.start()
        child.close()

    def stop(self) -> None:
        """Kill the process, then whatever its sandboxes left running, and delete their files."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        try:  # never raises: a replacement worker, or the pool's close, comes next
            reap_scratch_root(self.scratch)
        except Exception as e:  # noqa: BLE001 - what a sandbox left must not stop the pool
            logger.warning("cleaning up after reward worker %s failed: %s", self.process.pid, e)

    def kill(self) -> None:
        self.stop()
        self.conn.close()


class RewardPool:
    """``num_workers`` reward processes; ``await score(...)`` never raises for a bad completion.

    Only :attr:`reward_names` can be scored: the built-ins, the registered names and ``custom``
    (name -> ``"pkg.module:function"``, each imported and checked here, in the parent; a
    RewardConfigError carries the real import error). Counters ``num_scored``,
    ``num_timeouts`` and ``num_errors`` are there for metrics; the log shows each reward's
    first failures and timeouts in full and counts the rest (``RepeatedWarnings``), at
    ``failure_level``. Workers die
    with the thread that started them (Linux's parent-death signal, which holds when this
    process is SIGKILLed): create and use a pool in one long-lived thread, such as the event
    loop's.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        custom: dict[str, str] | None = None,
        start_method: str = "spawn",
        max_call_s: float = 600.0,
        timeouts_to_probe: int = 8,
        failure_level: int = logging.WARNING,
    ):
        if num_workers < 1:
            raise ValueError(f"RewardPool num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool timeout_s must be positive, got {timeout_s}")
        if not max_call_s >= timeout_s:
            raise ValueError(f"RewardPool max_call_s must be >= timeout_s ({timeout_s}), "
                             f"got {max_call_s}")
        if timeouts_to_probe < 1:
            raise ValueError(f"RewardPool timeouts_to_probe must be >= 1, got {timeouts_to_probe}")
        self.timeout_s = float(timeout_s)
        self.max_call_s = float(max_call_s)
        self.timeouts_to_probe = timeouts_to_probe
        self._timeouts_in_a_row: collections.Counter[str] = collections.Counter()
        self._probing: set[str] = set()  # rewards with a probe call running
        # failures and timeouts: the first of each reward logged, the rest counted
        self._warnings = RepeatedWarnings(logger, level=failure_level)
        self._custom = check_custom(custom)
        self._functions: dict[str, tuple[RewardFn, str]] = {}
        self._ctx = multiprocessing.get_context(start_method)
        reap_orphaned_scratch()
        self._idle = [_Worker(self._ctx) for _ in range(num_workers)]
        self._busy: set[_Worker] = set()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False
        self.num_scored = 0
        self.num_timeouts = 0
        self.num_errors = 0
        self.num_skipped = 0

    @property
    def reward_names(self) -> frozenset[str]:
        """Names :meth:`score` accepts: built-ins, registered names and the custom rewards."""
        return frozenset(available_rewards()) | frozenset(self._custom)

    async def score(self, reward_name: str, completion: str, metadata: dict) -> float:
        """Reward of ``completion``; 0.0 on timeout, crash or error.

        A name outside :attr:`reward_names` raises RewardNotFoundError before any work.
        """
        return (await self.score_with_error(reward_name, completion, metadata))[0]

    async def score_with_error(self, reward_name: str, completion: str, metadata: dict
                               ) -> tuple[float, str | None]:
        """(reward, None), or (0.0, what went wrong) when the call timed out, its worker
        crashed, the reward raised or it was skipped (the reward is being probed): :meth:`score`
        that tells a failure from a 0."""
        fn, path = self._resolve(reward_name)
        limit = min(self.timeout_s + _time_budget(fn, metadata), self.max_call_s)
        probe = self._hanging(reward_name)
        if probe:
            if reward_name in self._probing:
                return 0.0, self._skipped(reward_name)
            self._probing.add(reward_name)
        try:
            worker = await self._acquire()
            if not probe and self._hanging(reward_name):  # it began hanging while this waited
                self._release(worker, healthy=True)
                return 0.0, self._skipped(reward_name)
            healthy = False
            try:
                value, healthy, error = await self._call(
                    worker, reward_name, path, completion, metadata, limit
                )
            finally:
                self._release(worker, healthy)
        finally:
            if probe:
                self._probing.discard(reward_name)
        return value, error

    def score_sync(self, reward_name: str, completion: str, metadata: dict) -> float:
        """Blocking :meth:`score`, for tests and evaluation scripts outside an event loop."""
        return asyncio.run(self.score(reward_name, completion, metadata))

    def close(self) -> None:
        """Stop every worker; pending and later calls raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self._warnings.flush()
        for worker in self._idle:
            worker.kill()
        self._idle.clear()
        for worker in self._busy:  # their pending call sees EOF, scores 0.0 and closes the pipe
            worker.stop()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("RewardPool was closed"))

    async def __aenter__(self) -> RewardPool:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hanging(self, reward_name: str) -> bool:
        """Whether ``reward_name``'s last ``timeouts_to_probe`` calls all timed out."""
        return self._timeouts_in_a_row[reward_name] >= self.timeouts_to_probe

    def _skipped(self, reward_name: str) -> str:
        """Counts a call not run while ``reward_name`` is probed; the failure it reports."""
        self.num_skipped += 1
        return (f"reward {reward_name} skipped: its last {self._timeouts_in_a_row[reward_name]} "
                "calls in a row timed out, so it runs one call at a time until one ends in time")

    def _resolve(self, reward_name: str) -> tuple[RewardFn, str]:
        """(function, importable path) of a configured reward; others raise."""
        if reward_name not in self._functions:
            if reward_name in self._custom:
                path = self._custom[reward_name]
                self._functions[reward_name] = import_path(path), path
            elif reward_name in self.reward_names:
                fn = get_reward(reward_name)
                self._functions[reward_name] = fn, reward_path(fn)
            else:
                raise RewardNotFoundError(
                    f"reward {reward_name!r} is not configured for this pool; configured: "
                    f"{', '.join(sorted(self.reward_names))} (dotted paths must be registered "
                    "in config as custom rewards)"
                )
        return self._functions[reward_name]

    async def _acquire(self) -> _Worker:
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if self._idle:
            worker = self._idle.pop()
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                worker = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed a worker, then cancelled
                    self._busy.add(waiter.result())
                    self._release(waiter.result(), healthy=True)
                raise
        self._busy.add(worker)
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        """Return ``worker`` to the pool, or replace it when its state is unknown."""
        self._busy.discard(worker)
        if self._closed or not healthy:
            try:
                worker.kill()
            except Exception:  # noqa: BLE001 - its replacement starts all the same
                logger.warning("stopping a reward worker failed", exc_info=True)
            if self._closed:
                return
            worker = _Worker(self._ctx)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    async def _call(
        self, worker, reward_name, path, completion, metadata, limit
    ) -> tuple[float, bool, str | None]:
        """(reward, whether the worker is still usable, the failure if any) for one call on
        ``worker``."""
        self.num_scored += 1
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.conn.fileno()
        try:
            worker.conn.send((path, completion, metadata))
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await asyncio.wait_for(ready, limit)
            finally:
                loop.remove_reader(fd)
            status, value = worker.conn.recv()
        except TimeoutError:
            self.num_timeouts += 1
            self._timeouts_in_a_row[reward_name] += 1
            error = f"reward {reward_name} timed out after {limit:.1f}s"
            if self._timeouts_in_a_row[reward_name] == self.timeouts_to_probe:
                logger.warning("%s; worker restarted; %d calls in a row timed out: from now on "
                               "one call at a time runs, the others score 0", error,
                               self.timeouts_to_probe)
            else:
                self._warnings.warn(f"timeouts of reward {reward_name}", "%s; worker restarted",
                                    error)
            return 0.0, False, error
        except (EOFError, OSError) as e:
            self._timeouts_in_a_row.pop(reward_name, None)  # it ended, if badly
            self.num_errors += 1
            error = f"reward {reward_name} worker died ({e!r})"
            self._warnings.warn(f"failures of reward {reward_name}", "%s; worker restarted",
                                error)
            return 0.0, False, error
        if self._timeouts_in_a_row.pop(reward_name, 0) >= self.timeouts_to_probe:
            logger.warning("reward %s ended in time again: every call runs", reward_name)
        if status == "error":
            self.num_errors += 1
            error = f"reward {reward_name} failed: {value}"
            self._warnings.warn(f"failures of reward {reward_name}", "%s", error)
            return 0.0, True, error
        return value, True, None


def _time_budget(fn: RewardFn, metadata: dict) -> float:
    """Seconds ``fn`` declares it may need for ``metadata`` (``fn.time_budget_s``), else 0."""
    budget = getattr(fn, "time_budget_s", None)
    if budget is None:
        return 0.0
    try:
        return max(0.0, float(budget(metadata)))
    except Exception:  # bad metadata: the reward call itself reports it
        return 0.0
