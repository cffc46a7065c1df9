"""One trainer spread over several processes, driven by the leader's controller.

The leader (process 0) calls a ``TrainerGroup`` exactly like a ``Trainer``; each call first
sends the command and its inputs to the other processes, then runs it locally. The others sit
in ``follow()``, running every command they receive, so all processes execute the same jitted
steps on the same batch in the same order. After each command the processes agree that it
succeeded everywhere. A command that fails on a follower, wherever in its collectives, makes
that process record why (in ``jax.distributed``'s coordination service) and exit at once: the
leader's next collective then fails instead of waiting for a peer that will never come, and it
raises naming the follower's error; a follower that fails while the leader is between commands
(waiting for rollouts) ends the leader within ``FOLLOWER_FAILURE_GRACE_S`` too, naming it. A
command that fails on the leader ends the group there; the followers stop with the leader's
process. Either way the group is over. A follower sent SIGTERM or Ctrl-C asks the leader to
stop the run (as if the leader had been sent SIGTERM: the run stops cleanly, then the leader
releases the group) and keeps following meanwhile; a second signal ends it at once. A command
not finished after ``command_timeout_s`` (one process stuck in it, its heartbeats alive: a read
of a hung filesystem, say) ends the leader naming the processes yet to finish it; the run then
resumes from its last checkpoint when started again. With one process the group is a
pass-through.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import jax

from areal_jax.parallel import wire
from areal_jax.parallel.multihost import all_processes, broadcast_bytes, is_leader
from areal_jax.parallel.multihost import commands_done, exit_now, peer_failure_behind
from areal_jax.parallel.multihost import peer_failures, peer_stop_requests, record_commands_done
from areal_jax.parallel.multihost import report_failure, request_stop
from areal_jax.parallel.multihost import skip_shutdown_barrier
from areal_jax.stopping import stop_the_running

T = TypeVar("T")
log = logging.getLogger(__name__)
FOLLOWER_FAILURE_GRACE_S = 10.0
COMMAND_REPORT_S = 600.0  # a command running this long names the processes yet to finish it

if TYPE_CHECKING:
    from areal_jax.trainer.trainer import PublishSnapshot, Trainer
    from areal_jax.trajectory import TrajectoryGroup


class TrainerGroupBrokenError(RuntimeError):
    """A command failed because another process of the trainer group left it; the run resumes
    from its last checkpoint once every process is started again."""


def _peer_connection_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed as its connection to another process
    closed (Gloo's, on CPU, when a peer dies), not this process's own failure (its memory)."""
    text = str(error)
    return isinstance(error, jax.errors.JaxRuntimeError) and (
        "Gloo" in text or "by peer" in text)


class TrainerGroup:
    """A ``Trainer`` on every process of the group, commanded by the leader.

    The leader's calls run one at a time (from any thread; a call made while another runs
    waits for it): each is a sequence of collectives that every process runs in the same order.
    """

    def __init__(self, trainer: Trainer, command_timeout_s: float | None = None):
        self.trainer = trainer
        self.command_timeout_s = command_timeout_s  # None: a command may run for ever
        self._multi = jax.process_count() > 1
        self._broken = False  # a command failed somewhere: the others have left follow()
        self._commanding = threading.Lock()  # held from a command's send to its agreement
        self._closed = threading.Event()
        self._running: str | None = None  # the command in flight on the leader
        self._sent = 0  # commands the leader sent (followers: finished)
        self._running_since = 0.0  # monotonic time the command in flight was sent
        if self._multi and is_leader():
            threading.Thread(target=self._watch_followers, name="trainer-group-watch",
                             daemon=True).start()

    @property
    def version(self) -> int:
        """Completed updates of the policy (the same on every process)."""
        return self.trainer.version

    def train_on_batch(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """``Trainer.train_on_batch`` on every process; the metrics (identical everywhere)."""
        self.trainer.check_batch(groups)  # bad input raises here, before the others see it
        return self._command("train", *wire.groups_to_message(groups),
                             run=lambda: self.trainer.train_on_batch(groups))

    def sft_on_batch(self, examples) -> dict[str, float]:
        """``Trainer.sft_on_batch`` on every process."""
        self.trainer.check_sft(examples)
        return self._command("sft", *wire.examples_to_message(examples),
                             run=lambda: self.trainer.sft_on_batch(examples))

    def save(self, extra: dict | None = None) -> None:
        """Checkpoint on every process (each writes its own shards)."""
        self._command("save", {"extra": extra}, run=lambda: self.trainer.save(extra))

    def restore(self, version: int | None = None) -> dict | None:
        """Restore on every process; all land on the same version."""
        return self._command("restore", {"version": version},
                             run=lambda: self.trainer.restore(version))

    def snapshot_for_publish(self, version: int | None = None) -> PublishSnapshot:
        """Gather the parameters to the leader's host (every process takes part)."""
        return self._command("snapshot", {"version": version},
                             run=lambda: self.trainer.snapshot_for_publish(version))

    def publish(self, version: int | None = None) -> Path:
        """Snapshot on every process, then the leader writes the export."""
        return self.snapshot_for_publish(version).write()

    def compile_ahead_for(self, sketches) -> list[tuple[int, int]]:
        """``Trainer.compile_ahead_for`` on every process (each compiles for its own devices)."""
        sketches = [[int(n) for n in lengths] for lengths in sketches]
        shapes = self.trainer.compile_ahead_for(sketches)  # bad input raises before sending
        return self._command("sketches", {"sketches": sketches}, run=lambda: shapes)

    def expect_lengths(self, lengths, batch_trajectories: int) -> list[tuple[int, int]]:
        """``Trainer.expect_lengths`` on every process."""
        lengths = [int(n) for n in lengths]
        shapes = self.trainer.expect_lengths(lengths, batch_trajectories)
        return self._command("lengths", {"lengths": lengths,
                                         "batch_trajectories": batch_trajectories},
                             run=lambda: shapes)

    @property
    def compiles_ahead_in_helper(self) -> bool:
        """``Trainer.compiles_ahead_in_helper`` of the leader's trainer."""
        return self.trainer.compiles_ahead_in_helper

    def idle(self):
        """The leader waits (for a batch): ``Trainer.idle`` of its own trainer."""
        return self.trainer.idle()

    def close(self) -> None:
        """After the command in flight, if any (a step on a worker thread of a run that is
        stopping), release the other processes from ``follow()`` (unless a failed command ended
        the group: they have left it), then finish checkpoint writes."""
        with self._commanding:
            self._closed.set()
            try:
                if not self._broken:
                    self._send("close", {})
            except Exception as e:  # noqa: BLE001 - a follower is gone: said, and the
                # writes still finish here; the error that ended the run, if any, stands
                self._broken = True
                skip_shutdown_barrier()
                log.error("trainer group: could not release the other processes (%s)",
                          peer_failure_behind(e) or e)
            finally:
                self.trainer.close()

    def follow(self) -> None:
        """On a process other than the leader: run the leader's commands until ``close``.

        A command that fails here ends this process (``os._exit(1)``) after recording why for
        the leader, which raises naming it (see the module docstring); bad batches are refused
        on the leader before they are sent.
        """
        if is_leader():
            raise RuntimeError("follow() runs on the processes other than 0; the leader commands")
        with _stop_asked_of_the_leader():
            self._follow()

    def _follow(self) -> None:
        while True:
            command = "receive"
            try:
                with self.trainer.idle():  # waiting for the leader: compile ahead meanwhile
                    header, arrays = wire.unpack_message(broadcast_bytes(None))
                command = header.pop("command")
                if command == "close":
                    self.trainer.close()
                    return
                self._run(command, header, arrays)
                self._sent += 1
                record_commands_done(self._sent)  # for the leader to name a process stuck
            except BaseException as e:  # noqa: BLE001 - the process ends here, see below
                self._give_up(command, e)
            all_processes(True)  # the leader's agreement

    def _give_up(self, command: str, error: BaseException) -> None:
        """End this follower after ``command`` failed: in the middle of the command's
        collectives it could only wait for ever (the leader in a collective this process will
        not reach); its exit makes the leader's collective fail, and the leader names why."""
        where = f"process {jax.process_index()}, command {command!r}"
        message = f"{where}: {type(error).__name__}: {error}"
        report_failure(message)
        log.error("trainer group: %s failed; this process ends", where, exc_info=error)
        exit_now()

    def _command(self, command: str, header: dict, arrays=(), *, run: Callable[[], T]) -> T:
        """Send ``command`` to the other processes, run it here, agree on the outcome."""
        def send_and_run() -> T:
            self._send(command, header, arrays)  # a follower gone fails (or holds) it too
            return run()

        with self._commanding:
            self._sent += 1
            self._running, self._running_since = command, time.monotonic()
            try:
                return self._agree(command, send_and_run)
            finally:
                self._running = None

    def _watch_followers(self) -> None:
        """On the leader, until the group closes. A follower asked to stop: stop the run in
        progress (``run_stoppable``) as a SIGTERM here does. A follower that recorded a
        failure: give this side ``FOLLOWER_FAILURE_GRACE_S`` to fail on its own (a collective
        whose peer left raises), then end the process naming the error: a collective waiting
        for a peer that joins no more, or the next command, would otherwise hold until
        ``jax.distributed``'s heartbeat timeout, then abort. A command running long: see
        ``_report_slow_command`` and ``_end_overdue_command``."""
        stop_asked, reported = False, (0, 0)
        while not self._closed.wait(1.0):
            reported = self._report_slow_command(reported)
            self._end_overdue_command()
            if not stop_asked and (stops := peer_stop_requests()) and stop_the_running():
                stop_asked = True
                log.warning("trainer group: %s; stopping the run", "; ".join(stops))
            failures = peer_failures()
            if not failures or self._closed.wait(FOLLOWER_FAILURE_GRACE_S) or self._broken:
                continue
            where = (f"trainer-group command {self._running!r} failed on" if self._running
                     else "trainer group: between the leader's commands,")
            log.error("%s %s; the group cannot go on: the leader ends too", where,
                      "; ".join(failures))
            exit_now()

    def _report_slow_command(self, reported: tuple[int, int]) -> tuple[int, int]:
        """Every ``COMMAND_REPORT_S`` of a command in flight, name the processes yet to finish
        it (a process stuck in a read of a hung filesystem, say, holds the others in the
        command's collectives with its heartbeats alive). ``reported``: (command number,
        reports made for it); returns the new one."""
        command, seq = self._running, self._sent
        if command is None:
            return reported
        count = reported[1] if reported[0] == seq else 0
        running_s = time.monotonic() - self._running_since
        if running_s < COMMAND_REPORT_S * (count + 1):
            return seq, count
        log.warning("trainer-group command %r has run for %.0f s; processes yet to finish it: "
                    "%s", command, running_s, _yet_to_finish(seq))
        return seq, count + 1

    def _end_overdue_command(self) -> None:
        """A command in flight for ``command_timeout_s``: end the leader, naming the processes
        yet to finish it (the others then end at ``jax.distributed``'s heartbeat timeout)."""
        command, seq, limit = self._running, self._sent, self.command_timeout_s
        if command is None or limit is None:
            return
        running_s = time.monotonic() - self._running_since
        if running_s < limit:
            return
        self._broken = True
        log.error("trainer-group command %r has not finished in %.0f s "
                  "(process_group.command_timeout_s); processes yet to finish it: %s. The group "
                  "cannot go on: the leader ends; started again, the run resumes from its last "
                  "checkpoint", command, running_s, _yet_to_finish(seq))
        exit_now()

    def _agree(self, command: str, run: Callable[[], T]) -> T:
        """On the leader: ``run()``, then agree with every process that it succeeded; a
        failure here, or a follower's (its exit fails our collectives), marks the group over
        and raises, naming the follower's error where one was recorded."""
        try:
            result = run()
            if self._multi:
                all_processes(True)
            return result
        except BaseException as e:  # Ctrl-C too: the followers may be inside this command
            if not self._multi:
                raise
            self._broken = True
            skip_shutdown_barrier()  # the followers are gone, or stuck until this process ends
            again = ("The group cannot go on: start the same command on every process again, "
                     "and the run resumes from its last checkpoint")
            if (behind := peer_failure_behind(e)) is not None:  # a peer left the group
                raise TrainerGroupBrokenError(
                    f"trainer-group command {command!r} failed on {behind}. {again}") from e
            if _peer_connection_lost(e):  # a peer left, recording nothing
                first = str(e).strip().splitlines()[0]
                raise TrainerGroupBrokenError(
                    f"trainer-group command {command!r} failed: a collective with the other "
                    f"trainer processes broke ({first}), none of them having recorded an "
                    "error: one was killed (SIGKILL, the out-of-memory killer) or its host or "
                    f"network went down. {again}") from e
            raise

    def _send(self, command: str, header: dict, arrays=()) -> None:
        if self._broken:
            raise RuntimeError(f"{command}: the trainer group ended when a command failed")
        if self._multi:
            if not is_leader():
                raise RuntimeError(f"{command}: only the leader (process 0) commands the group")
            broadcast_bytes(wire.pack_message({"command": command, **header}, arrays))

    def _run(self, command: str, header: dict, arrays) -> None:
        t = self.trainer
        if command == "train":
            t.train_on_batch(wire.groups_from_message(header, arrays))
        elif command == "sft":
            t.sft_on_batch(wire.examples_from_message(header, arrays))
        elif command == "save":
            t.save(header["extra"])
        elif command == "restore":
            t.restore(header["version"])
        elif command == "snapshot":
            t.snapshot_for_publish(header["version"])
        elif command == "sketches":
            t.compile_ahead_for(header["sketches"])
        elif command == "lengths":
            t.expect_lengths(header["lengths"], header["batch_trajectories"])
        else:
            raise RuntimeError(f"unknown trainer-group command {command!r}")


def _yet_to_finish(seq: int) -> str:
    """The processes that have not recorded finishing the leader's command number ``seq``."""
    done = commands_done()
    waiting = [str(i) for i in range(1, jax.process_count()) if done.get(i, 0) < seq]
    return ", ".join(waiting) or "0 (the leader) alone"


@contextlib.contextmanager
def _stop_asked_of_the_leader() -> Iterator[None]:
    """On a follower: the first SIGTERM or SIGINT asks the leader to stop the run (the
    follower goes on until the leader closes the group); a second one stops it here."""
    signals = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in signals}
    asked = False

    def ask(signum, frame):
        nonlocal asked
        if asked:
            raise KeyboardInterrupt
        asked = True
        name = signal.Signals(signum).name
        request_stop(f"process {jax.process_index()} was sent {name}")
        log.warning("%s: the leader stops the run and then releases this process; a second "
                    "signal ends it now", name)

    for s in signals:
        signal.signal(s, ask)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
