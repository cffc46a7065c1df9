"""Several JAX processes as one trainer: start-up, the leader, and the few host collectives.

Every process runs the same jitted programs on one global mesh; process 0 (the leader) owns the
controller and sends the others what to run. The helpers here are collectives: every process
calls them in the same order (with one process they are local no-ops).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

_FAILURES = "areal_jax/failures/"  # coordination-service keys: why a process gave up
_STOPS = "areal_jax/stops/"  # ... and which process was asked to stop (SIGTERM, Ctrl-C)
_DONE = "areal_jax/done/"  # ... and how many commands of the leader each follower finished


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
    heartbeat_timeout_s: int = 100, join_timeout_s: int = 300, bind_address: str | None = None,
) -> None:
    """Join the process group; call before any JAX computation.

    ``heartbeat_timeout_s``: how long a process may stop answering (SIGKILLed, its host down)
    before ``jax.distributed`` ends every process of the group (a fatal error naming it).
    ``join_timeout_s``: how long to wait for the whole group (every process started, the
    coordinator reachable); past it ``jax.distributed`` aborts this process (SIGABRT, a
    ``DEADLINE_EXCEEDED`` from ``RegisterTask``), which cannot be caught, so what it waits for
    is said on stderr first.

    Arguments left out are read from the cluster's environment by ``jax.distributed`` (TPU pod
    metadata, SLURM ``SLURM_*`` variables, Open MPI). CPU processes exchange collectives over
    gloo (TCP). A process uses every accelerator it can see (one process per host; narrow it with
    ``CUDA_VISIBLE_DEVICES`` or ``trainer_devices``): left to itself, ``jax.distributed`` would
    give a SLURM or Open MPI process only the device of its local rank (one GPU of eight).
    ``bind_address``: where process 0's coordination service listens (``host:port``; unset:
    every interface, at the coordinator's port).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would take SIGTERM over (a `kill`, `scancel` or `docker stop`
    # did nothing until the scheduler's SIGKILL); the run handles it like a single process.
    jax.config.update("jax_enable_preemption_service", False)
    who = (f"process {process_id} of {num_processes}" if process_id is not None
           else "a process (rank from the cluster's environment)")
    print(f"joining the trainer's process group as {who}, coordinator "
          f"{coordinator or 'from the environment'}: waiting up to {join_timeout_s} s for every "
          "process (process_group.join_timeout_s); past it this process is aborted with "
          "DEADLINE_EXCEEDED", file=sys.stderr, flush=True)
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
        local_device_ids=[],  # not None: no device restriction (None means the local rank's)
        heartbeat_timeout_seconds=heartbeat_timeout_s, initialization_timeout=join_timeout_s,
        coordinator_bind_address=bind_address,
    )


def is_leader() -> bool:
    """True on process 0, the one that runs the controller and writes shared files."""
    return jax.process_index() == 0


def broadcast_bytes(data: bytes | None) -> bytes:
    """The leader's ``data`` on every process (the others pass None)."""
    if jax.process_count() == 1:
        return data
    if is_leader() and data is None:
        raise ValueError("the leader must pass the bytes to broadcast")
    size = int(multihost_utils.broadcast_one_to_all(np.array([len(data or b"")], np.int64))[0])
    # Padded to a power of two so the broadcast compiles once per size class, not per message.
    buffer = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    if is_leader():
        buffer[:size] = np.frombuffer(data, np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes()


def all_processes(flag: bool) -> bool:
    """True when ``flag`` is true on every process."""
    if jax.process_count() == 1:
        return flag
    flags = multihost_utils.process_allgather(np.array([flag], np.int32))
    return bool(np.all(flags))


def host_array(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` on this host (gathered from the other processes when needed)."""
    if not x.is_fully_addressable and not x.is_fully_replicated:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def same_on_all(values) -> bool:
    """True when the integers ``values`` are the same on every process."""
    if jax.process_count() == 1:
        return True
    rows = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return bool(np.all(rows == rows[0]))


def _coordination_client():
    from jax._src import distributed

    return distributed.global_state.client


def _record(prefix: str, message: str) -> None:
    client = _coordination_client()
    if client is not None:
        with contextlib.suppress(Exception):
            client.key_value_set(f"{prefix}{jax.process_index()}", message[:4000])


def _records_of_others(prefix: str) -> list[str]:
    client = _coordination_client()
    if client is None:
        return []
    own = f"{prefix}{jax.process_index()}"
    try:
        return [value for key, value in client.key_value_dir_get(prefix) if key != own]
    except Exception:  # noqa: BLE001 - a diagnostic: its absence is not an error
        return []


def report_failure(message: str) -> None:
    """Record why this process fails, for the others to name (best effort: the coordination
    service lives in process 0)."""
    _record(_FAILURES, message)


def peer_failures() -> list[str]:
    """What the other processes reported with ``report_failure`` (none when unreachable)."""
    return _records_of_others(_FAILURES)


def request_stop(message: str) -> None:
    """Record that this process was asked to stop, for the leader to stop the run."""
    _record(_STOPS, message)


def peer_stop_requests() -> list[str]:
    """What the other processes recorded with ``request_stop``."""
    return _records_of_others(_STOPS)


def record_commands_done(count: int) -> None:
    """Record that this process finished ``count`` commands of the leader."""
    _record(_DONE, str(count))


def commands_done() -> dict[int, int]:
    """Per process that recorded any: how many commands of the leader it finished."""
    client = _coordination_client()
    if client is None:
        return {}
    try:
        return {int(key.rsplit("/", 1)[1]): int(value)
                for key, value in client.key_value_dir_get(_DONE)}
    except Exception:  # noqa: BLE001 - a diagnostic: its absence is not an error
        return {}


def peer_failure_behind(error: BaseException) -> str | None:
    """What the other processes recorded (``report_failure``) when ``error`` is a collective
    that failed because one of them gave up; None otherwise."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    return "; ".join(peer_failures()) or None


def differences_from_leader(fields: dict) -> tuple[list[str], bool]:
    """Compare ``fields`` (JSON data) with the leader's, on every process: the dotted keys
    where this process's differ, and whether every process agrees. A process that differs
    records which keys (``report_failure``) before the processes agree."""
    if jax.process_count() == 1:
        return [], True
    mine = json.loads(json.dumps(fields, sort_keys=True, default=str))
    sent = json.dumps(mine).encode() if is_leader() else None
    differ = _differing_keys(mine, json.loads(broadcast_bytes(sent)))
    if differ:
        report_failure(f"process {jax.process_index()} differs from process 0 at "
                       f"{', '.join(differ)}")
    return differ, all_processes(not differ)


def _differing_keys(mine, theirs, prefix: str = "") -> list[str]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [key for k in sorted(set(mine) | set(theirs))
                for key in _differing_keys(mine.get(k), theirs.get(k), f"{prefix}{k}.")]
    return [] if mine == theirs else [prefix.rstrip(".")]


@contextlib.contextmanager
def failure_ends_group(active: bool = True) -> Iterator[None]:
    """Around work every process of the group runs together outside a ``TrainerGroup``
    command (start-up checks, SFT, restore): a failure here is recorded for the others and
    ends this process at its exit without ``jax.distributed``'s shutdown barrier, where it
    would wait for processes stuck in a collective this one left, then abort; they fail
    within seconds instead, naming it where they can. ``active`` False: a pass-through."""
    try:
        yield
    except BaseException as e:
        if not active or jax.process_count() == 1:
            raise
        if (behind := peer_failure_behind(e)) is None:
            report_failure(f"process {jax.process_index()}: {type(e).__name__}: {e}")
            skip_shutdown_barrier()
            raise
        named = RuntimeError(f"another trainer process failed: {behind}")
        report_failure(f"process {jax.process_index()}: RuntimeError: {named}")
        skip_shutdown_barrier()
        raise named from e


def skip_shutdown_barrier() -> None:
    """Make this process, at its exit, skip ``jax.distributed``'s shutdown barrier: after the
    group broke, the other processes may never reach it (one waiting in a collective this
    process left), and the barrier would hold the exit for its timeout, then abort. Registered
    after JAX's own exit handler, this runs first and ends the process (exit code 1: the group
    failed)."""
    atexit.register(exit_now)


def exit_now() -> None:
    """End this process at once with exit code 1 (no exit handlers), its output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
