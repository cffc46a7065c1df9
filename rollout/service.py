"""The ``RolloutService`` RPC handlers.

On the Rollout stream a bad request does not end the stream: its TrajectoryGroup comes back
with ``error`` set (code, field, message) and the other requests carry on, because one stream
carries many independent prompts. The other RPCs concern one thing each and fail with a
status code (INVALID_ARGUMENT naming the field, FAILED_PRECONDITION for a stale version, a
path outside the allowed roots or a checkpoint that does not load, UNAVAILABLE while shutting
down or once the engine failed). ``end`` returns every unfinished group as an error with one
code: ABORTED at shutdown, UNAVAILABLE when the engine failed for good. ``drain`` (a server
told to stop with ``drain_s``) lets the groups held finish but admits nothing new: each open
Rollout stream is told once (an error group with ``draining`` set and no request id), and each
request that still arrives comes back unrun the same way, for its client to send elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import grpc
import numpy as np

from areal_jax.protocol import finish_reason_to_proto, group_to_proto
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.protocol.v1 import rollout_pb2_grpc as pb_grpc
from areal_jax.repeated_warnings import RepeatedWarnings
from areal_jax.trajectory import TrajectoryGroup
from rollout.admission import Admission, AdmissionClosed
from rollout.config import ServerConfig
from rollout.run_lease import RunLease, run_of
from rollout.engine import (
    EngineError,
    GenerationChunk,
    GenerationEngine,
    InvalidParamError,
    WeightLoadError,
)
from rollout.timing import ActivityClock, ThroughputMeter, TimedEngine, TimedScorer
from rollout.validation import MAX_REQUEST_ID_CHARS, Limits, check_version_range
from rollout.validation import generate_args_from_proto, rollout_task_from_proto
from rollout.weight_intake import PushStalledError, PushStream, WeightIntake
from rollout.wire import abort
from rollout.workflows.base import RewardScorer, RolloutTask, Workflow

log = logging.getLogger(__name__)


def _push_failure(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a failed push is answered with: a bad stream is the client's error, a stalled
    one a deadline, a full disk a resource exhausted, any other write failure internal."""
    if isinstance(error, InvalidParamError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, PushStalledError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    return (grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL,
            f"writing weights: {error}")
_DONE = object()


# Per Rollout stream, replies not sent yet (the client's flow-control window is full) before
# the server stops reading its requests: a count, and their bytes (a reply may be up to
# max_message_mb); and the bytes of all streams together, past which every stream with a reply
# waiting stops reading (streams are at most ``max_rollout_streams``).
MAX_UNREAD_REPLIES = 256
MAX_UNREAD_BYTES = 256 << 20
MAX_UNREAD_BYTES_ALL_STREAMS = 512 << 20
PUSH_DRAIN_S = 2.0  # how long the rest of a rejected push is read before the status is sent


def _quoted(path: str, limit: int = 200) -> str:
    """``path`` for a message: its first ``limit`` characters when longer, with its length."""
    return path if len(path) <= limit else f"{path[:limit]}... ({len(path)} characters)"


class _Unsent:
    """The bytes of the replies waiting to be sent on all of a server's Rollout streams."""

    def __init__(self):
        self.bytes = 0


class _Replies(asyncio.Queue):
    """A Rollout stream's replies waiting to be sent, their bytes counted in ``bytes`` and in
    the server's ``unsent`` (each reply's size computed once)."""

    def __init__(self, unsent: _Unsent):
        super().__init__()
        self.bytes = 0
        self.unsent = unsent
        self.closed = False
        self._sizes: collections.deque[int] = collections.deque()

    def _put(self, item):
        if self.closed:  # its client is gone: nothing will take it
            return
        super()._put(item)
        self._sizes.append(item.ByteSize() if isinstance(item, pb.TrajectoryGroup) else 0)
        self.bytes += self._sizes[-1]
        self.unsent.bytes += self._sizes[-1]

    def _get(self):
        size = self._sizes.popleft()
        self.bytes -= size
        self.unsent.bytes -= size
        return super()._get()

    def close(self) -> None:
        """Drop the replies left, and any put from now on: the stream closed."""
        while not self.empty():
            self.get_nowait()
        self.closed = True


def _held_back(replies: _Replies) -> bool:
    """Whether a stream's client has ``MAX_UNREAD_REPLIES`` replies, or ``MAX_UNREAD_BYTES``
    of them, it has not read, or has some while all streams together have
    ``MAX_UNREAD_BYTES_ALL_STREAMS``."""
    return (replies.qsize() >= MAX_UNREAD_REPLIES or replies.bytes >= MAX_UNREAD_BYTES
            or (replies.bytes > 0 and replies.unsent.bytes >= MAX_UNREAD_BYTES_ALL_STREAMS))


async def _until_read(replies: _Replies) -> None:
    """Wait while the stream is ``_held_back``: the server reads no further request meanwhile
    (gRPC flow control then holds the client), so clients that send without reading cannot
    grow the server's memory without bound, and a client that reads is not held back by one
    that does not (until its own replies wait too)."""
    while _held_back(replies):
        await asyncio.sleep(0.02)


class Rejected(Exception):
    """An RPC that fails with ``code``; turned into a status at the handler boundary."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class _Place:
    """A group's place in admission: queued until ``started``, then a running slot; its
    request's message bytes count against ``max_admitted_mb`` until it ends."""

    size: int
    started: bool = False


class _Unfinished(Exception):
    """A group did not complete: the server ended it, or the engine aborted one of its samples."""


class _NonFinite(Exception):
    """A generated token's log-prob is not finite: finite weights whose forward pass
    overflows pass every check of the load, and such output must not pass as a result."""

    def __init__(self, version: int):
        super().__init__(f"the served weights (version {version}) gave a non-finite log-prob "
                         "(weights that overflow in the forward pass, most likely)")
        self.version = version


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _error_group(request_id: str, code: grpc.StatusCode, message: str, field: str = ""):
    error = pb.RequestError(code=code.value[0], field=field, message=message)
    return pb.TrajectoryGroup(request_id=request_id[:MAX_REQUEST_ID_CHARS], error=error)


_DRAINING = "the server is draining before it stops: it takes no new work"


def _draining_group(request_id: str) -> pb.TrajectoryGroup:
    group = _error_group(request_id, grpc.StatusCode.UNAVAILABLE, _DRAINING)
    group.error.draining = True
    return group


def _chunk_to_proto(chunk: GenerationChunk) -> pb.GenerateChunk:
    finish = chunk.finish_reason
    return pb.GenerateChunk(
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        versions=chunk.versions,
        finish_reason=finish_reason_to_proto(finish) if finish else pb.FINISH_REASON_UNSPECIFIED,
    )


def _check_group(group: TrajectoryGroup, task: RolloutTask) -> None:
    """Hold a workflow to its contract (``rollout.workflows.base``)."""
    if group.group_id != task.request_id:
        raise RuntimeError(f"workflow returned group_id {group.group_id!r}")
    if len(group.trajectories) != task.group_size:
        raise RuntimeError(f"workflow returned {len(group.trajectories)} trajectories for "
                           f"group_size {task.group_size}")
    for traj in group.trajectories:
        if tuple(traj.prompt_ids.tolist()) != task.prompt_ids:
            raise RuntimeError("workflow returned a trajectory with another prompt")
        bad = (traj.output_mask == 1) & ~np.isfinite(traj.behav_logprobs)  # generated ones
        if bad.any():
            raise _NonFinite(int(traj.versions[bad][0]))


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Runs workflows on the engine and streams the groups back; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        engine: GenerationEngine,
        workflow: Workflow,
        scorer: RewardScorer,
        reward_names: Collection[str],
        push_dir: Path,
    ):
        self._config = config
        self._engine = engine
        self._workflow = workflow
        self._scorer = scorer
        self._reward_names = reward_names
        self._admission = Admission(config.max_queued_requests, config.max_concurrent_groups,
                                    config.max_admitted_mb << 20)
        self._meter = ThroughputMeter()
        self._update_lock = asyncio.Lock()
        self._intake = WeightIntake(push_dir, config.push_idle_timeout_s,
                                    config.push_min_mib_per_s * 2**20)
        # a configured push_dir is the root, as it was before each server had its own in it
        self._weight_roots = config.allowed_weight_roots(config.push_dir or str(push_dir))
        self._readers: set[asyncio.Task] = set()
        self._end: tuple[grpc.StatusCode, str] | None = None
        self._ended = asyncio.Event()
        self._draining = False
        self._lease = RunLease(config.run_lease_s)
        self._streams: set[_Replies] = set()  # the replies of each open Rollout stream
        self._unsent = _Unsent()
        self._instance_id = uuid.uuid4().hex  # tells the trainer this process from a restart
        self._non_finite_versions: set[int] = set()  # logged once each (``_warn_non_finite``)
        # requests failed by a defect (a workflow's bug): the first tracebacks of each exception
        self._unexpected = RepeatedWarnings(log, level=logging.ERROR)

    @property
    def held(self) -> int:
        """Groups queued or generating."""
        return self._admission.queued + self._admission.running

    @property
    def push_dir(self) -> Path:
        """Where pushed checkpoints are written (this process's own directory)."""
        return self._intake.root

    @property
    def closing(self) -> bool:
        return self._end is not None

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Stop reading and admitting requests; every group not complete yet, queued or
        generating, comes back as an error group with ``code`` (the first ``end`` decides)."""
        if self._end is None:
            self._end = (code, message)
        self._unexpected.flush()
        self._admission.close()
        self._ended.set()
        for reader in self._readers:
            reader.cancel()

    @property
    def draining(self) -> bool:
        """Whether ``drain`` began: no new request is admitted."""
        return self._draining

    @property
    def open_streams(self) -> int:
        """Rollout streams open now."""
        return len(self._streams)

    def drain(self) -> None:
        """Admit no new request (the groups held go on to finish); tell every open Rollout
        stream's client so, to send its next requests elsewhere."""
        if self._draining:
            return
        self._draining = True
        for replies in self._streams:
            replies.put_nowait(_draining_group(""))

    def _ended_group(self, request_id: str) -> pb.TrajectoryGroup:
        return _error_group(request_id, *self._end)

    async def _unless_ended(self, coro):
        """Await ``coro``; if ``end`` comes first, cancel it and raise ``_Unfinished``."""
        work = asyncio.ensure_future(coro)
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({work, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not work.done():
                work.cancel()
            # retrieved, also when this task is cancelled after the work failed (else asyncio
            # logs the work's error as never retrieved)
            await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise _Unfinished("the server ended the request")
        return work.result()

    def _limits(self) -> Limits:
        return Limits(
            vocab_size=self._engine.vocab_size,
            max_context_len=self._engine.max_context_len,
            reward_names=self._reward_names,
            max_group_size=self._config.max_group_size,
        )

    # Rollout ---------------------------------------------------------------------------------

    async def Rollout(self, request_iterator, context):
        if self.closing:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"server is closing: {self._end[1]}")
        run = await self._caller(context)
        if len(self._streams) >= self._config.max_rollout_streams:
            await abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server has max_rollout_streams ({self._config.max_rollout_streams}) "
                "Rollout streams open: close one (a client needs one stream per server) or raise "
                "max_rollout_streams")
        out = _Replies(self._unsent)
        if self._draining:  # its client learns it first: what it sends is turned away unrun
            out.put_nowait(_draining_group(""))
        tasks: set[asyncio.Task] = set()
        reader = asyncio.create_task(self._read(request_iterator, out, tasks))
        self._readers.add(reader)
        self._streams.add(out)
        self._lease.stream_opened(run)
        try:
            while (item := await out.get()) is not _DONE:
                yield item
        finally:
            self._lease.stream_closed(run)
            self._streams.discard(out)
            self._readers.discard(reader)
            reader.cancel()
            for task in tasks:
                task.cancel()
            out.close()

    async def _read(self, requests: AsyncIterator, out: _Replies, tasks: set) -> None:
        """Admit each request of one stream; put ``_DONE`` once all its groups are out."""
        jobs: dict[str, asyncio.Task] = {}  # by request_id, the groups in flight
        try:
            async for req in requests:
                if req.cancel:  # withdrawn by its client: nothing comes back for it
                    if (job := jobs.get(req.request_id)) is not None:
                        job.cancel()
                    continue
                await _until_read(out)
                if self._draining:  # not run here: its client sends it elsewhere
                    out.put_nowait(_draining_group(req.request_id))
                    continue
                try:
                    task = rollout_task_from_proto(req, self._limits())
                    if task.request_id in jobs:
                        raise InvalidParamError("request_id", "already in flight on this stream")
                except InvalidParamError as e:
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    out.put_nowait(_error_group(req.request_id, code, str(e), e.field))
                    continue
                place = _Place(size=req.ByteSize())
                await self._admission.reserve(place.size)
                if self._draining:  # it waited for a place while the drain began
                    self._admission.release(False, place.size)
                    out.put_nowait(_draining_group(req.request_id))
                    continue
                job = asyncio.create_task(self._run_group(task, out, place))
                jobs[task.request_id] = job
                tasks.add(job)
                job.add_done_callback(tasks.discard)
                job.add_done_callback(lambda _, rid=task.request_id: jobs.pop(rid, None))
                # Given back when the job ends, however: a job cancelled before its first step
                # (the client gone) runs none of its own code.
                job.add_done_callback(lambda _, place=place: self._admission.release(
                    place.started, place.size))
        except (asyncio.CancelledError, AdmissionClosed):
            pass  # shutdown or client gone: finish what was admitted
        except InvalidParamError as e:  # a message that does not decode: the stream is unusable
            code = grpc.StatusCode.INVALID_ARGUMENT
            out.put_nowait(_error_group("", code, str(e), e.field))
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            out.put_nowait(_DONE)

    async def _run_group(self, task: RolloutTask, out: _Replies, place: _Place) -> None:
        admitted = time.monotonic()
        try:
            await self._admission.start()
            place.started = True
            queue_s = time.monotonic() - admitted
            gen_clock, reward_clock = ActivityClock(), ActivityClock()
            scorer = TimedScorer(self._scorer, reward_clock)
            group = await self._unless_ended(self._workflow.run(
                task, TimedEngine(self._engine, gen_clock, self._meter.add), scorer))
            _check_group(group, task)
            if any(t.finish_reason == "abort" for t in group.trajectories):
                raise _Unfinished("the engine aborted a sample")
            timing = {
                "queue_s": queue_s,
                "generation_s": gen_clock.total,
                "reward_s": reward_clock.total,
            }
            msg = self._fits_one_message(group_to_proto(group, timing, scorer.failures,
                                                        scorer.calls))
        except Exception as e:  # noqa: BLE001 - reported to the client, the stream goes on
            msg = self._failure(task.request_id, _first_leaf(e))
        out.put_nowait(msg)

    def _warn_non_finite(self, exc: _NonFinite) -> None:
        """Log ``exc`` once per weight version (every request then fails alike)."""
        if exc.version not in self._non_finite_versions:
            self._non_finite_versions.add(exc.version)
            log.error("%s (each request generated with them fails with INTERNAL)", exc)

    def _fits_one_message(self, msg: pb.TrajectoryGroup) -> pb.TrajectoryGroup:
        """``msg``, or, when it exceeds ``max_message_mb`` (gRPC would end the whole stream
        with every other group on it), an ``OUT_OF_RANGE`` error group in its place."""
        size, limit = msg.ByteSize(), self._config.max_message_mb << 20
        if size <= limit:
            return msg
        log.warning("request %s: a reply of %d bytes exceeds max_message_mb (%d MiB)",
                    msg.request_id, size, self._config.max_message_mb)
        return _error_group(
            msg.request_id, grpc.StatusCode.OUT_OF_RANGE,
            f"the group's reply ({size} bytes) exceeds the server's max_message_mb "
            f"({self._config.max_message_mb} MiB): lower group_size or max_new_tokens, or raise "
            "max_message_mb on the server and its clients", "group_size")

    def _failure(self, request_id: str, exc: BaseException) -> pb.TrajectoryGroup:
        if self.closing:  # whatever went wrong, the request did not complete: end's code says why
            return self._ended_group(request_id)
        if isinstance(exc, _Unfinished):
            return _error_group(request_id, grpc.StatusCode.ABORTED, str(exc))
        if isinstance(exc, _NonFinite):
            self._warn_non_finite(exc)
            return _error_group(request_id, grpc.StatusCode.INTERNAL, str(exc))
        if isinstance(exc, InvalidParamError):
            return _error_group(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field)
        if isinstance(exc, EngineError):
            log.warning("request %s: engine failed: %s", request_id, exc)
            return _error_group(request_id, grpc.StatusCode.UNAVAILABLE, f"engine: {exc}")
        self._unexpected.warn(f"requests failed with {type(exc).__name__}",
                              "request %s failed", request_id, exc_info=exc)
        return _error_group(request_id, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    # Generate --------------------------------------------------------------------------------

    async def Generate(self, request, context):
        if self._draining:
            await abort(context, grpc.StatusCode.UNAVAILABLE, _DRAINING)
        run = await self._caller(context)
        self._lease.stream_opened(run)  # its caller is around while it generates
        try:
            async for chunk in self._generate(request, context):
                yield chunk
        finally:
            self._lease.stream_closed(run)

    async def _generate(self, request, context):
        try:
            request_id, prompt, params = generate_args_from_proto(request, self._limits())
        except InvalidParamError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        size = request.ByteSize()
        try:
            await self._admission.reserve(size)
        except AdmissionClosed:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self._draining:  # it waited for a place while the drain began
            self._admission.release(False, size)
            await abort(context, grpc.StatusCode.UNAVAILABLE, _DRAINING)
        started = False
        try:
            await self._admission.start()
            started = True
            chunks = self._engine.generate(prompt, params, request_id)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.finish_reason == "abort" and self.closing:
                        raise _Unfinished("the server ended the request")
                    bad = ~np.isfinite(np.asarray(chunk.logprobs, np.float32))
                    if bad.any():
                        raise _NonFinite(int(np.asarray(chunk.versions)[bad][0]))
                    self._meter.add(len(chunk.token_ids))
                    yield _chunk_to_proto(chunk)
        except (AdmissionClosed, _Unfinished):
            await abort(context, *self._end)
        except _NonFinite as e:
            self._warn_non_finite(e)
            await abort(context, grpc.StatusCode.INTERNAL, str(e))
        except EngineError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"engine: {e}")
        finally:
            self._admission.release(started, size)

    # Weights ---------------------------------------------------------------------------------

    def _check_weights_path(self, path: str) -> str:
        """The real path of ``path``, which must lie under ``weights_allowed_roots``: the one
        loaded, so a link changed after the check leads nowhere else."""
        if "\0" in path:
            raise InvalidParamError("path", "contains a NUL character")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self._weight_roots):
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"path: {_quoted(path)} (real path {_quoted(real)}) is not under "
                f"weights_allowed_roots "
                f"{self._weight_roots}: start this server with weights_allowed_roots naming "
                "a directory that holds it (e.g. where the trainer's run directories are), or "
                "set the trainer's rollout.weights_transport=push",
            )
        return real

    def _check_version(self, version: int, force: bool, field: str = "version") -> None:
        """Without ``force`` only a newer version may load."""
        if not force and version <= self._engine.version:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{field}: {version} is not newer than the serving version {self._engine.version} "
                "(set force to load it anyway)",
            )

    async def _caller(self, context) -> str:
        """The run the call names (``rollout.run_lease``), noted as heard from."""
        try:
            run = run_of(context)
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._lease.heard(run)
        return run

    def _check_run(self, run: str) -> None:
        if (why := self._lease.refusal(run)) is not None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, why)

    async def _update(self, path: str, version: int, force: bool, run: str,
                      pushed: Path | None = None) -> pb.UpdateWeightsResponse:
        """Load ``path`` as ``version`` for ``run``, one load at a time. A load runs to its end
        even when its caller gives up (a deadline cancels the call): abandoned half way it could
        leave the engine partly updated, or its thread still loading beside the next load. The
        update lock is held until it ends. ``pushed``: a pushed directory, kept if it loads,
        removed if not."""
        try:
            await self._update_lock.acquire()
        except BaseException:
            if pushed is not None:
                self._intake.discard(pushed)
            raise
        try:
            if self.closing:
                raise Rejected(grpc.StatusCode.UNAVAILABLE, f"server is closing: {self._end[1]}")
            self._check_run(run)
            self._check_version(version, force)
        except BaseException:
            self._loaded(path, version, pushed, None)
            raise
        load = asyncio.ensure_future(self._load(path, version, run))
        load.add_done_callback(functools.partial(self._loaded, path, version, pushed))
        return await asyncio.shield(load)

    def _loaded(self, path: str, version: int, pushed: Path | None,
                load: asyncio.Future | None) -> None:
        """A load ended (``load`` None: it never started): release the update lock, keep or
        remove a pushed directory."""
        self._update_lock.release()
        failed = load is None or load.cancelled() or load.exception() is not None
        error = None if load is None or load.cancelled() else load.exception()
        # (an INTERNAL one, an engine's own defect, was logged with its traceback by _load)
        if isinstance(error, Rejected) and error.code != grpc.StatusCode.INTERNAL:
            log.warning("loading %s as version %d failed: %s", path, version, error)
        if pushed is not None:
            (self._intake.discard if failed else self._intake.keep)(pushed)

    async def _load(self, path: str, version: int, run: str) -> pb.UpdateWeightsResponse:
        start = time.monotonic()
        try:
            await self._engine.update_weights(path, version)
            self._lease.loaded(run)
        except WeightLoadError as e:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"path: {e}") from e
        except EngineError as e:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"engine: {e}") from e
        except Exception as e:  # noqa: BLE001 - an engine's own defect: reported, not UNKNOWN
            log.exception("loading %s as version %d failed", path, version)
            raise Rejected(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e!s:.300}") from e
        load_s = time.monotonic() - start
        log.info("now serving version %d (loaded %s in %.1f s)", version, path, load_s)
        return pb.UpdateWeightsResponse(version=self._engine.version, load_s=load_s)

    async def UpdateWeights(self, request, context):
        run = await self._caller(context)
        try:
            if not request.path:
                raise InvalidParamError("path", "must not be empty")
            check_version_range(request.version, "version")
            real = self._check_weights_path(request.path)
            return await self._update(real, request.version, request.force, run)
        except InvalidParamError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Rejected as e:
            await abort(context, e.code, str(e))

    async def PushWeights(self, request_iterator, context):
        run = await self._caller(context)
        stream = PushStream(request_iterator)

        def check_header(header: pb.WeightsHeader) -> None:  # before any byte is received
            self._check_run(run)
            self._check_version(header.version, header.force, "header.version")

        try:
            # Received outside the update lock: a slow stream holds back no other update.
            directory, header = await self._intake.receive(stream, check_header)
            return await self._update(str(directory), header.version, header.force, run,
                                      pushed=directory)
        except Rejected as e:  # the caller's run or version: the caller is told
            code, message = e.code, str(e)
        except (InvalidParamError, PushStalledError, OSError) as e:
            code, message = _push_failure(e)
            log.warning("a weights push failed (%s): %s", code.name, message)
        # Read what the client still sends (for a bounded time) before answering: a status
        # sent while it is mid-stream can reach it as a transport error instead.
        await stream.drain(PUSH_DRAIN_S)
        await abort(context, code, message)

    # Control ---------------------------------------------------------------------------------

    async def Pause(self, request, context):
        return await self._control(self._engine.pause, context)

    async def Resume(self, request, context):
        return await self._control(self._engine.resume, context)

    async def _control(self, action, context) -> pb.ServerStatus:
        """Pause or resume the engine, for the run it serves (or any caller while it serves
        none, or once that run's trainer has been gone ``run_lease_s``): another run's pause
        is not this caller's to lift, nor its generation to stop."""
        run = await self._caller(context)
        try:
            self._check_run(run)
            await action()
        except Rejected as e:
            await abort(context, e.code, str(e))
        except EngineError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"engine: {e}")
        return self.status()

    async def GetStatus(self, request, context):
        await self._caller(context)
        return self.status()

    async def Release(self, request, context):
        self._lease.release(await self._caller(context))
        return self.status()

    def status(self) -> pb.ServerStatus:
        engine = self._engine
        stats = {k: float(v) for k, v in engine.stats().items()}
        stats["tokens_as_generated"] = float(engine.tokens_as_generated)
        return pb.ServerStatus(
            version=engine.version,
            running_requests=self._admission.running,
            queued_requests=self._admission.queued,
            tokens_generated=self._meter.total,
            tokens_per_second=self._meter.rate(),
            engine_kind=engine.kind,
            paused=engine.paused,
            vocab_size=engine.vocab_size,
            max_context_len=engine.max_context_len,
            engine_stats=stats,
            instance_id=self._instance_id,
            draining=self._draining,
            run_id=self._lease.run,
            reward_names=sorted(self._reward_names),
            max_group_size=self._config.max_group_size,
        )
