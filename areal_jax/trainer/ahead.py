"""Compiling ahead: programs a later step will need, compiled on a background thread.

A new micro-batch shape met in the middle of a run costs its programs' compilation inside the
step, on the critical path of the loop. The trainer instead asks for the shapes a later batch
is likely to need (``forecast.ShapeForecast``, then ``packing.neighbour_shapes``) as soon as a
step has used its own, and this thread compiles them while the next batches are generated; the
step that first meets such a shape finds it compiled. Jobs are keyed: a key compiled, queued or
running is not compiled again; jobs run in the order queued, except that the owner may move
keys to the front (``prioritise``: a fresh forecast outranks older guesses); and a step about
to need a key ``claim``s it first (it waits for a running job, and takes a queued one off the
queue to compile it itself, as it would have anyway).

Where the owner's steps run on the CPUs that compile (a CPU backend), jobs start only inside
the owner's ``idle()`` windows: the loop opens one while it waits for rollouts to fill a batch,
a follower process while it waits for the leader's next command. Tracing and lowering hold Python's GIL and compiling takes CPU, so a compile beside a step
slows the step; in a long wait, where the trainer would idle anyway, it costs the loop nothing.
A job that started in a window finishes, and where it outlasts the window it runs beside the
next steps: its thread runs at the lowest CPU priority (nice ``NICE``), so its tracing and
lowering, Python work, leave the steps the CPU, but XLA compiles on threads of its own at the
process's priority (``benchmarks/compile_beside_step.py``: on one core, steps beside the Python
part ran at full speed, beside XLA's part about 2x slower). So a job starts only once the window
has lasted ``settle_s`` and, judged by the windows before it and the jobs compiled so far, is
likely to cover at least half of a job (``start_after``). The short gaps of a loop whose
trainer is the bottleneck end before ``settle_s`` (measured on the 2-core CPU, starting jobs
in those gaps made the quickstart's RL phase about 20% slower); the waits of a synchronous
trainer whose rollouts take about a second are longer than that but much shorter than a
compile (in the long-tail benchmark, steps beside such spilled jobs took 1.4-1.7x as long per
token). Such a trainer compiles nothing ahead after its first long wait, and its new shapes
compile in the step, as without this thread. A GPU or TPU trainer's steps run on the
accelerator, not on the host CPUs that compile, so there a job starts as soon as it is queued,
windows or not (``fit_to_waits=False``): a trainer that is the loop's slow side never waits, and
on one H200 with a 0.5B-shaped model the rule of waiting for a window compiled nothing ahead
after the first version, leaving 56% of the RL phase to compiles inside steps
(``benchmarks/results/gpu.md``, run 12). There several jobs may also run at once
(``workers`` threads: tracing and lowering hold the GIL, XLA's compile does not); one at a
time is the trainer's default, since eight at once on a 16-core host made each job 3-8x as
long and a step that needed one waited 82 s for it (run 14).

With a ``CompileHelper`` (a child process at the lowest priority, ``compile_helper``), jobs
run there instead, each as soon as it is queued, windows or not: the process takes only CPU time
nobody else wants, so it cannot slow the steps the way this process's own compiles do. The
helper compiles into the persistent cache, and the step that needs the programs loads them from
it. A step that needs a key the helper is still compiling waits for it, but no longer than the
helper's longest job of that kind so far (``DEFAULT_PATIENCE_S`` before one finished): a helper starved of
CPU time is not waited for. If the helper ends or cannot start, the jobs run on the thread
from then on, under the rules above.

A job that fails is logged and dropped: the step then compiles the program itself, as without
compiling ahead. The thread is marked for ``CompileMeter``, so its seconds, and the helper's,
are reported apart from the step's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

from areal_jax.compilation import CompileMeter, compiling_ahead
from areal_jax.trainer.compile_helper import HelperGone

log = logging.getLogger(__name__)

NICE = 19  # the compile thread's nice value: the lowest CPU priority
_HISTORY = 32  # idle windows and job durations remembered for ``start_after``
DEFAULT_PATIENCE_S = 30.0  # how long a step waits for the helper's job before any finished


def start_after(windows: list[float], job_s: float | None, settle_s: float) -> float:
    """Seconds into an idle window after which a job may start, given how long earlier windows
    lasted (``windows``) and how long a job takes (``job_s``; None before any finished).

    The earliest ``t >= settle_s`` at which the windows that lasted at least ``t`` would, on
    average, have covered at least half of a job started at ``t`` (the rest runs beside the
    owner's next work). A window that outlasts every earlier one is out of what history shows:
    the job starts. With no history or no job duration yet: ``settle_s``.
    """
    if not windows or not job_s:
        return settle_s
    for t in sorted({settle_s, *(w for w in windows if w > settle_s)}):
        lasted = [w for w in windows if w >= t]
        if not lasted:
            return t
        if statistics.fmean(max(0.0, t + job_s - w) for w in lasted) <= job_s / 2:
            return t
    return max(windows)


class AheadCompiler:
    """A background thread that runs keyed compile jobs, each at most once, itself or in a
    helper process."""

    def __init__(self, settle_s: float = 1.0, name: str = "compile-ahead",
                 fit_to_waits: bool = True, helper: Callable[[Hashable], float] | None = None,
                 workers: int = 1):
        """``fit_to_waits``: start jobs only in idle windows, where ``start_after`` says they
        mostly fit (where a compile slows the owner's steps: a CPU backend); False: as soon as
        they are queued (an accelerator's steps do not run on the host CPUs that compile).
        ``helper``: run jobs by their key with it instead (it returns the seconds the job took;
        e.g. ``CompileHelper.compile`` for one trainer), without waiting for windows.
        ``workers``: jobs run at once, each on a thread of its own; more than one only where
        jobs start as soon as queued on this process's threads (no ``helper``, not
        ``fit_to_waits``)."""
        if workers < 1 or (workers > 1 and (helper is not None or fit_to_waits)):
            raise ValueError(f"workers must be 1, or more only without a helper and with "
                             f"fit_to_waits=False; got {workers}")
        self._workers = workers
        self._helper = helper
        self._settle_s = settle_s
        self._fit_to_waits = fit_to_waits
        self._name = name
        self._cv = threading.Condition()
        self._queue: collections.OrderedDict[Hashable, Callable[[], None]] = (
            collections.OrderedDict())
        self._running: set[Hashable] = set()
        self._done: set[Hashable] = set()
        self._failed: set[Hashable] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._idle = 0  # idle windows open: jobs start only while > 0
        self._idle_since = 0.0  # when the current stretch of open windows began
        self._windows: collections.deque[float] = collections.deque(maxlen=_HISTORY)
        self._job_seconds: collections.deque[float] = collections.deque(maxlen=_HISTORY)
        self._longest_of_kind: dict[Hashable, float] = {}  # per _kind, the longest job so far

    @property
    def in_helper(self) -> bool:
        """Whether jobs run in the helper process (until it fails, if it does)."""
        return self._helper is not None

    def submit(self, key: Hashable, compile_fn: Callable[[], None]) -> bool:
        """Queue ``compile_fn`` under ``key`` unless that key was already submitted or claimed;
        returns whether it was queued."""
        with self._cv:
            if self._closed or self._known(key):
                return False
            self._queue[key] = compile_fn
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                    for i in range(self._workers)]
                for thread in self._threads:
                    thread.start()
            self._cv.notify_all()
            return True

    def prioritise(self, keys: Sequence[Hashable]) -> None:
        """Move those of ``keys`` still queued to the front of the queue, in that order."""
        with self._cv:
            for key in reversed(keys):
                if key in self._queue:
                    self._queue.move_to_end(key, last=False)

    def claim(self, key: Hashable) -> bool:
        """The caller is about to need ``key``'s programs: wait while the thread compiles them
        (for the helper: at most its longest job so far); a job still queued is dropped (the caller
        compiles it). Returns whether they were compiled ahead."""
        with self._cv:
            self._queue.pop(key, None)
            patience = self._patience_s(key)
            deadline = None if patience is None else time.monotonic() + patience
            while key in self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    log.info("not waiting longer for the compile helper's %s: compiling it "
                             "here", key)
                    break
                self._cv.wait(left)
            compiled = key in self._done
            self._done.add(key)  # from now on the caller's own call has compiled it
            return compiled

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """A window in which the owner waits: queued jobs start meanwhile."""
        with self._cv:
            if self._idle == 0:
                self._idle_since = time.monotonic()
            self._idle += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._idle -= 1
                if self._idle == 0:
                    self._windows.append(time.monotonic() - self._idle_since)

    def compiled(self) -> set[Hashable]:
        """Keys compiled (by the thread, or claimed by a caller)."""
        with self._cv:
            return set(self._done)

    def failed(self) -> set[Hashable]:
        """Keys whose job failed (not queued again: the step compiles them itself)."""
        with self._cv:
            return set(self._failed)

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return len(self._queue) + len(self._running)

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._running, timeout)

    def close(self, wait: bool = True) -> None:
        """Drop queued jobs and (``wait``) wait for the running ones: a compile on a thread
        cannot be interrupted; one in the helper is waited for at most ``_patience_s()`` (the
        helper may be starved of CPU, or stopped), then left to the helper (the thread is a
        daemon). Closing again waits for what the first close did not."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            threads, patience = list(self._threads), self._patience_s()
        if not wait:
            return
        for thread in threads:
            thread.join(patience)
            if thread.is_alive():  # a compile ahead of need: nothing waits for it
                log.info("closed without waiting longer than %.0f s for the compile helper's "
                         "job", patience)

    def _patience_s(self, key: Hashable | None = None) -> float | None:
        """How long a claim of ``key`` (None: any job) waits for a running job: without limit
        on the thread; for the helper, its longest job of that kind so far
        (``DEFAULT_PATIENCE_S`` before one finished; a quick job of another kind says nothing
        of a train step's compile), as it may be starved of CPU time."""
        if self._helper is None:
            return None
        if key is None:
            return max(self._longest_of_kind.values(), default=DEFAULT_PATIENCE_S)
        return self._longest_of_kind.get(_kind(key), DEFAULT_PATIENCE_S)

    def _wait_s(self) -> float | None:
        """How long the worker waits before a job may start: 0 now, None until notified."""
        if not self._queue:
            return None
        if self._helper is not None or not self._fit_to_waits:
            return 0.0
        if not self._idle:
            return None
        job_s = statistics.median(self._job_seconds) if self._job_seconds else None
        after = start_after(list(self._windows), job_s, self._settle_s)
        return max(0.0, self._idle_since + after - time.monotonic())

    def _known(self, key: Hashable) -> bool:
        return (key in self._done or key in self._queue or key in self._running
                or key in self._failed)

    def _work(self) -> None:
        _lower_this_threads_priority()
        with compiling_ahead():
            while True:
                with self._cv:
                    while not self._closed and (wait := self._wait_s()) != 0:
                        self._cv.wait(wait)
                    if self._closed:
                        return
                    key, job = self._queue.popitem(last=False)
                    self._running.add(key)
                began = time.monotonic()
                try:
                    self._run(key, job)
                    ok = True
                except HelperGone as e:
                    self._lose_helper(key, job, e)
                    continue
                except Exception:  # noqa: BLE001 - the step compiles it itself instead
                    log.warning("compiling %s ahead failed; the step that needs it will compile "
                                "it", key, exc_info=True)
                    ok = False
                seconds = time.monotonic() - began
                if ok:
                    log.info("compiled %s ahead in %.1f s", key, seconds)
                with self._cv:
                    (self._done if ok else self._failed).add(key)
                    if ok:
                        self._job_seconds.append(seconds)
                        kind = _kind(key)
                        self._longest_of_kind[kind] = max(
                            seconds, self._longest_of_kind.get(kind, 0.0))
                    self._running.discard(key)
                    self._cv.notify_all()

    def _run(self, key: Hashable, job: Callable[[], None]) -> None:
        """Run one job: in the helper, by its key, if there is one; else ``job`` here."""
        helper = self._helper
        if helper is None:
            job()
            return
        CompileMeter.add_ahead(helper(key))

    def _lose_helper(self, key: Hashable, job: Callable[[], None], error: HelperGone) -> None:
        """The helper is gone: put ``key`` back first in line, go on with this thread."""
        with self._cv:
            self._running.discard(key)
            if not self._closed:
                log.warning("%s; compiling ahead on a thread of the trainer from now on", error)
                self._queue[key] = job
                self._queue.move_to_end(key, last=False)
            self._helper = None
            self._cv.notify_all()


def _lower_this_threads_priority() -> None:
    """Give the calling thread the lowest CPU priority, where the OS sets priorities per thread
    (Linux); elsewhere it keeps the process's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except OSError as e:
        log.warning("could not lower the compile-ahead thread's priority: %s", e)


def _kind(key: Hashable) -> Hashable:
    """What a job compiles (``"train"``, ``"update"``, ...: the first item of a tuple key),
    whatever shape it is for."""
    return key[0] if isinstance(key, tuple) and key else key
