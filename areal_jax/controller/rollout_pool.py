"""Client side of N rollout servers: one open ``Rollout`` stream each, least-loaded routing, and
a guarantee that no accepted request is lost.

* A request whose server dies (stream broken, unreachable, hung on a control call past its
  deadline), or that comes back with an error the server — not the request — is to blame for
  (UNAVAILABLE, ABORTED, INTERNAL, ...), is sent again to another live server. Only
  INVALID_ARGUMENT (and other request-specific codes) come back to the caller as the request's
  own error, as does a request larger than ``max_message_mb`` (it would break the stream it
  went on). A request that fails ``max_attempts`` times (counting the replies that report its
  server going away and the streams that broke while it was on them: a request that takes
  down every server it reaches must not cycle forever) fails with ``RequestFailedError``
  instead of looping.
* Transport pings every ``keepalive_s`` find a server that stopped answering (a frozen process,
  a dead host, a partition) while its stream stays open: it is taken out of the pool.
* A server that holds groups, sends none back and generates no token for ``stall_timeout_s``
  (up to twice that: its token count is read once per period), its process alive (a wedged
  engine), is taken out of the pool the same way (not a server whose engine counts tokens only
  as sequences end: SGLang), its groups charged a failed send; so is one that answers
  ``max_attempts`` distinct groups in a row with a server fault (it answers at once, so
  least-loaded routing would send it most new groups), and one that goes away again (a broken
  stream, a group answered UNAVAILABLE) before it completes a group since it joined. Each
  rejoins after a backoff that doubles with each such strike in a row, and after
  ``max_attempts`` only once it is restarted (its status names another process:
  ``instance_id``).
* With no live server, requests wait; a supervisor task tries dead servers every
  ``rejoin_interval_s`` and brings one that answers SERVING again back to the current weights
  (a forced update) before it gets work. Each server's try runs on its own, and publishing
  waits for one only to load a version published while it loaded the one before (which it
  did load), and at most ``max(rpc_timeout_s, 3 x`` that first load``)``: a server that hangs
  loading its rejoin weights holds up nothing else for longer, and one slower to load than
  versions come still rejoins.
  If no server is reachable for ``no_server_timeout_s`` every waiting request fails with
  ``NoLiveServerError``.
* The pool pauses and resumes its servers (``pause``, ``resume``: a synchronous run, while it
  trains); a server that joins meanwhile is brought to that state as it joins, and one of
  this run (or of none) found paused not by this trainer (a stopped trainer of the run left it
  so, or a resume was lost) is resumed as it joins or once it holds groups it makes no
  progress on; another run's pause is left alone. Closing the pool resumes what it paused.
* With ``addresses_file`` servers join and leave as lines are added and removed: a server
  unlisted while it holds groups gets no new work, finishes them, then leaves (should it fail
  or stall first, they go elsewhere as above). So does a server that says it is draining (told
  to stop, it finishes what it holds first): a request it turned away unrun goes elsewhere,
  not counted as a failed send; it rejoins like any server once it serves again.
* Every group that comes back is checked against its request and the model
  (``protocol.group_check``); one that fails counts as its server failing it.
* Every control call (update, push, pause, resume, status) has a deadline; UNAVAILABLE is
  retried ``rpc_retries`` times with backoff; a server still failing (or past its deadline) is
  taken out of the pool, its groups go elsewhere, and it may rejoin later. A server that
  refuses a weight update another server took leaves the pool the same way and rejoins with a
  forced load, tried less and less often while it keeps refusing, and after ``max_attempts``
  refusals in a row (an error in the log says so) only once it is restarted; an update no
  live server took is an error (``WeightsRejectedError``): the export itself is bad.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_jax.controller.busy import BusyClock
from areal_jax.protocol import SERVICE_NAME, push_weight_requests
from areal_jax.protocol.addresses import read_addresses_file
from areal_jax.protocol.group_check import group_problem
from areal_jax.protocol.runs import MAX_RUN_ID_CHARS, RUN_METADATA_KEY, is_run_id
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.protocol.v1 import rollout_pb2_grpc as pb_grpc
from areal_jax.trainer.publish import export_in_use

log = logging.getLogger(__name__)

_S = grpc.StatusCode
_NO_VERSION_YET = 2**62  # before the first weights: servers serve their own
# Error groups whose request is generated again elsewhere: the server failed, not the request.
_SERVER_GONE = {_S.UNAVAILABLE.value[0], _S.ABORTED.value[0], _S.CANCELLED.value[0]}
_SERVER_FAULT = {_S.INTERNAL.value[0], _S.UNKNOWN.value[0], _S.DEADLINE_EXCEEDED.value[0],
                 _S.RESOURCE_EXHAUSTED.value[0]}


_DRAINING = "is draining before it stops"
_RELEASE_S = 5.0  # longest wait, at close, for a server to take note the run is done with it
# A server taking this many times as long to load weights as the fastest one did (or as it
# did itself the last time), and longer than rpc_timeout_s, is taken for stuck.
STRAGGLER_FACTOR = 3.0


class NoLiveServerError(RuntimeError):
    """No rollout server has been reachable for too long; nothing can be generated."""


class ServerRefusedError(RuntimeError):
    """A rollout server answers but refuses the trainer (a missing or wrong token)."""


class RequestFailedError(RuntimeError):
    """One request failed on the servers too many times (not because a server died)."""


class WeightsRejectedError(RuntimeError):
    """A rollout server refused a checkpoint (path not allowed, corrupt or mismatched files)."""


@dataclasses.dataclass
class PoolOptions:
    """Deadlines and retry budgets of the pool (``rollout.*`` in the experiment config)."""

    rpc_timeout_s: float = 60.0  # status, pause, resume
    update_timeout_s: float = 600.0  # UpdateWeights / PushWeights, loading included
    rpc_retries: int = 3  # extra attempts of a control call that found the server UNAVAILABLE
    rejoin_interval_s: float = 5.0
    no_server_timeout_s: float = 300.0
    max_attempts: int = 8  # sends of one request before it fails for good
    max_message_mb: int = 64
    keepalive_s: float = 20.0  # ping interval, and how long a ping may go unanswered
    max_rejoin_backoff_s: float = 600.0  # longest wait between rejoins of a refusing server
    stall_timeout_s: float = 300.0  # groups in flight, none back and no token generated: out


@dataclasses.dataclass
class _Weights:
    path: str
    version: int
    push: bool


@dataclasses.dataclass
class _Server:
    address: str
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.RolloutServiceStub | None = None
    outbox: asyncio.Queue | None = None
    call: object = None
    reader: asyncio.Task | None = None
    in_flight: dict[str, pb.RolloutRequest] = dataclasses.field(default_factory=dict)
    alive: bool = False
    version: int | None = None
    busy: BusyClock = dataclasses.field(default_factory=BusyClock)
    rejoin_error: str | None = None  # why its last rejoin failed once it answered SERVING
    rejoin_failures: int = 0  # rejoins in a row that failed once it answered SERVING
    pings_refused: int = 0  # connections it ended for the trainer's keepalive pings
    next_rejoin: float = 0.0  # monotonic time of its next rejoin try
    progress_at: float = 0.0  # monotonic time it last showed progress (or got work when idle)
    tokens_seen: int = -1  # its tokens_generated at that time (-1: not asked yet)
    strikes: int = 0  # times in a row it left the pool for stalling or failing every group
    instance: str = ""  # the id of its process, as its status last said ("": not told)
    vocab_size: int = 0  # as its status said; the token ids it returns must be below it
    shut_out: str | None = None  # the process kept out for the rest of the run; a new one
    # (the server restarted) may rejoin
    faults: set[str] = dataclasses.field(default_factory=set)  # the distinct groups it failed
    # in a row with a server fault (INTERNAL, ...): one group failing again counts once
    fault_error: str | None = None  # the last of those faults, logged once while it repeats
    draining: bool = False  # it said it takes no new work: it leaves once its groups are back
    completed: bool = False  # it completed a group since it last joined the pool
    joined_at: float = 0.0  # monotonic time it last joined the pool
    load_s: float = 0.0  # how long its last accepted weight update took (0: not timed yet)


class RolloutPool:
    """Routes rollout requests to the least-loaded live server; each ``submit`` returns a future
    resolved with the server's ``TrajectoryGroup`` (or its request-specific error)."""

    def __init__(self, addresses: list[str], auth_token: str | None = None,
                 tls_root_cert: bytes | None = None, options: PoolOptions | None = None,
                 admit: Callable[[str, pb.ServerStatus], None] | None = None,
                 addresses_file: Path | None = None, run_id: str | None = None):
        """``admit(address, status)`` raises ``ValueError`` naming why a server cannot serve
        this run (a context too short for its prompts, say): at the start that error ends
        ``start``; a server joining later stays out of the pool until it is restarted.
        ``addresses_file`` lists more servers, one address per line; it is read again every
        ``rejoin_interval_s``: a server whose line is added joins the pool like a server
        coming back, one whose line is removed gets no new work and leaves once the groups it
        holds are back. ``run_id`` names the run in every call: a server serving another run's
        weights refuses this one's while that run's trainer is around (``rollout.run_lease``)."""
        if run_id is not None and not is_run_id(run_id):
            raise ValueError(f"run id {run_id!r}: 1 to {MAX_RUN_ID_CHARS} printable ASCII "
                             "characters")
        self._addresses_file = addresses_file
        self._fixed = list(dict.fromkeys(addresses))
        self._file_problem: str | None = None  # why it could not be read last, logged once
        if addresses_file is not None:
            try:
                addresses = self._fixed + [a for a in read_addresses_file(addresses_file)
                                           if a not in self._fixed]
            except (OSError, ValueError) as e:
                raise ValueError(f"rollout.addresses_file: {_reason(e)}") from None
        if not addresses:
            raise ValueError("rollout.addresses: at least one rollout server is needed (or "
                             "rollout.addresses_file listing one)")
        self.options = options or PoolOptions()
        self._admit = admit
        metadata = ((("authorization", f"Bearer {auth_token}"),) if auth_token else ()) + (
            ((RUN_METADATA_KEY, run_id),) if run_id else ())
        self._metadata = metadata or None
        self._run_id = run_id
        self._tls = tls_root_cert
        mb = self.options.max_message_mb << 20
        ping_ms = int(self.options.keepalive_s * 1000)
        self._channel_options = [("grpc.max_send_message_length", mb),
                                 ("grpc.max_receive_message_length", mb),
                                 ("grpc.keepalive_time_ms", ping_ms),
                                 ("grpc.keepalive_timeout_ms", ping_ms),
                                 ("grpc.http2.ping_timeout_ms", ping_ms),  # what gRPC 1.8x uses
                                 ("grpc.keepalive_permit_without_calls", 1),
                                 ("grpc.http2.max_pings_without_data", 0)]
        self._servers = [_Server(a) for a in dict.fromkeys(addresses)]
        self._futures: dict[str, asyncio.Future] = {}
        self._attempts: dict[str, int] = {}
        self._parked: list[pb.RolloutRequest] = []
        self._none_live_since: float | None = None
        self._weights: _Weights | None = None
        self._newest_version = _NO_VERSION_YET  # the newest version a server may serve
        self._weights_lock = asyncio.Lock()
        self._supervisor: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None  # reads addresses_file
        self._leaving: dict[int, _Server] = {}  # by id(): unlisted, finishing their groups
        self._rejoining: dict[str, asyncio.Task] = {}  # address -> its rejoin attempt
        self._stall_checks: dict[str, asyncio.Task] = {}  # address -> its progress check
        self._closing: list[asyncio.Task] = []
        self._paused = False  # whether the pool wants its servers paused (``pause``)
        self.resubmitted = 0  # requests sent again after a server failure

    # ---- connections ---------------------------------------------------------------------
    def _new_channel(self, address: str) -> grpc.aio.Channel:
        if self._tls is not None:
            creds = grpc.ssl_channel_credentials(self._tls)
            return grpc.aio.secure_channel(address, creds, options=self._channel_options)
        return grpc.aio.insecure_channel(address, options=self._channel_options)

    async def start(self, ready_timeout_s: float = 120.0,
                    report_every_s: float | None = None) -> None:
        """Connect to every server (each has ``ready_timeout_s`` to answer, all at once), open
        the streams and start the supervisor that lets failed servers rejoin. Servers that do
        not answer in time join later, like failed ones; none answering is
        ``NoLiveServerError``, and a server refusing the token is ``ServerRefusedError``.
        ``report_every_s``: name the servers not answering yet that often (a warning)."""
        channels = [self._new_channel(s.address) for s in self._servers]
        asks = [asyncio.ensure_future(self._answers(s, c, ready_timeout_s))
                for s, c in zip(self._servers, channels)]
        start = time.monotonic()
        try:
            while True:
                done, pending = await asyncio.wait(asks, timeout=report_every_s,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                if not pending or any(a.exception() is not None for a in done):
                    break
                silent = [s.address for s, a in zip(self._servers, asks) if a in pending]
                log.warning("waiting for rollout servers to answer: %s (%.0f of %.0f s; not "
                            "started yet, unreachable, or on another port?)", ", ".join(silent),
                            time.monotonic() - start, ready_timeout_s)
            for ask in asks:  # the first refusal, the others cancelled
                if ask.done() and ask.exception() is not None:
                    raise ask.exception()
            absent = [ask.result() for ask in asks]  # why each is not ready (None: ready)
        except BaseException:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)  # none left on a closed channel
            await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
            raise
        if all(why is not None for why in absent):
            await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
            draining = [s.address for s, why in zip(self._servers, absent) if why == _DRAINING]
            if len(draining) == len(absent):
                raise NoLiveServerError(f"every rollout server answered that it is draining "
                                        f"before it stops: {', '.join(draining)}")
            raise NoLiveServerError(
                f"no rollout server answered within {ready_timeout_s:g} s "
                f"(rollout.start_timeout_s; tried "
                f"{', '.join(self.addresses)}): not started yet, unreachable, or TLS on one "
                "side only (rollout.tls_root_cert on the trainer, tls_cert_path on the servers)"
                + (f"; draining before they stop: {', '.join(draining)}" if draining else ""))
        for server, channel, why in zip(self._servers, channels, absent):
            if why is None:
                self._open(server, channel)
            else:
                await channel.close()
                log.warning("rollout server %s %s; going on without it (it joins once it "
                            "serves)", server.address,
                            why or f"did not answer within {ready_timeout_s:.0f} s")
        self._supervisor = asyncio.create_task(self._supervise())
        if self._addresses_file is not None:
            self._follower = asyncio.create_task(self._follow_addresses_file())

    async def _answers(self, server: _Server, channel: grpc.aio.Channel,
                       timeout: float) -> str | None:
        """None when ``server`` answers on ``channel`` within ``timeout`` and is admitted, else
        why not ("" for no answer); ``ServerRefusedError`` when it answers but refuses the
        trainer's token."""
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            status = await pb_grpc.RolloutServiceStub(channel).GetStatus(
                pb.GetStatusRequest(), timeout=self.options.rpc_timeout_s,
                metadata=self._metadata)
        except TimeoutError:
            return ""
        except grpc.aio.AioRpcError as e:
            if e.code() in (_S.UNAUTHENTICATED, _S.PERMISSION_DENIED):
                raise ServerRefusedError(
                    f"rollout server {server.address} refuses the trainer: {e.code().name}: "
                    f"{e.details()}; rollout.auth_token_env must name a variable holding the "
                    "servers' token") from None
            return ""
        if status.draining:  # stopping: it joins if it serves again
            return _DRAINING
        server.instance, server.vocab_size = status.instance_id, status.vocab_size
        if self._admit is not None:
            self._admit(server.address, status)
        try:
            await self._match_pause(server.address, pb_grpc.RolloutServiceStub(channel), status)
        except grpc.aio.AioRpcError:
            return ""
        return None

    async def _match_pause(self, address: str, stub, status: pb.ServerStatus) -> None:
        """Pause or resume the server at ``address`` (``status``: as it is now) as the pool
        wants its servers, until that holds, if it serves no run or this one (another run's
        pause is that run's to lift): a server a stopped trainer of this run left paused, or
        whose resume was lost, would hold its groups for good (its status says paused, which
        is no stall)."""
        if status.run_id and status.run_id != (self._run_id or ""):
            return
        paused, arrived_paused = status.paused, status.paused
        while paused != self._paused:
            want = self._paused
            call = stub.Pause(pb.PauseRequest(), timeout=self.options.rpc_timeout_s,
                              metadata=self._metadata) if want else stub.Resume(
                pb.ResumeRequest(), timeout=self.options.rpc_timeout_s, metadata=self._metadata)
            await call
            if arrived_paused and not want:
                log.warning("rollout server %s was paused, not by this run's current "
                            "trainer; resumed", address)
                arrived_paused = False
            paused = want

    def _open(self, server: _Server, channel: grpc.aio.Channel) -> None:
        """Open ``server``'s Rollout stream on ``channel`` and route work to it."""
        server.channel, server.stub = channel, pb_grpc.RolloutServiceStub(channel)
        server.outbox = asyncio.Queue()
        server.call = server.stub.Rollout(self._requests_of(server.outbox), metadata=self._metadata)
        server.alive, server.draining, server.completed = True, False, False
        server.progress_at, server.tokens_seen = time.monotonic(), -1
        server.joined_at = server.progress_at
        server.reader = asyncio.create_task(self._read(server, server.call))
        self._route_parked()

    def _route_parked(self) -> None:
        """Route the requests parked while no server took work, if one does now (a server
        listed again may be draining: the wait for a server goes on)."""
        if not any(s.alive and not s.draining for s in self._servers):
            return
        self._none_live_since = None
        parked, self._parked = self._parked, []
        for request in parked:
            if request.request_id in self._futures:
                self._route(request)

    @staticmethod
    async def _requests_of(outbox: asyncio.Queue):
        while (request := await outbox.get()) is not None:
            yield request

    def _mark_dead(self, server: _Server, reason: str, charge: bool = False) -> None:
        """Take ``server`` out of the pool; its groups are sent to other servers (``charge``:
        each is counted one failed send, as when its stream broke under it)."""
        if not server.alive:
            return
        server.alive = False
        self._leaving.pop(id(server), None)
        orphans = list(server.in_flight.values())
        server.in_flight.clear()
        server.busy.clear()
        log.warning("rollout server %s left the pool (%s); resubmitting its %d groups",
                    server.address, reason, len(orphans))
        server.outbox.put_nowait(None)
        if server.call is not None:
            server.call.cancel()
        if server.reader is not None and server.reader is not asyncio.current_task():
            server.reader.cancel()
        if server.channel is not None:
            self._closing.append(asyncio.create_task(server.channel.close()))
        server.channel = server.stub = server.call = None
        for request in orphans:
            if request.request_id not in self._futures:
                continue
            if charge and self._failed_for_good(request.request_id, server, reason):
                continue
            self.resubmitted += 1
            self._route(request, avoid=server)

    # ---- routing -------------------------------------------------------------------------
    @property
    def live_servers(self) -> list[str]:
        """The servers that take new work."""
        return [s.address for s in self._servers if s.alive and not s.draining]

    @property
    def published_version(self) -> int | None:
        """The version every server in the pool has confirmed loading (None before any)."""
        return self._weights.version if self._weights else None

    def busy_clocks(self) -> dict[str, BusyClock]:
        """Per server address, the clock of time it had at least one group in flight."""
        return {s.address: s.busy for s in self._servers}

    def in_flight(self) -> int:
        return len(self._futures)

    def submit(self, request: pb.RolloutRequest) -> asyncio.Future:
        """Send ``request`` to the least-loaded live server; the future gets its group."""
        if request.request_id in self._futures:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        future = asyncio.get_running_loop().create_future()
        size, limit = request.ByteSize(), self.options.max_message_mb << 20
        if size > limit:  # it would end its server's stream, and every group on it
            error = pb.RequestError(
                code=_S.INVALID_ARGUMENT.value[0], field="request",
                message=f"the request is {size} bytes, over max_message_mb "
                        f"({self.options.max_message_mb} MiB)")
            future.set_result(pb.TrajectoryGroup(request_id=request.request_id, error=error))
            return future
        self._futures[request.request_id] = future
        self._attempts[request.request_id] = 0
        self._route(request)
        return future

    def _route(self, request: pb.RolloutRequest, avoid: _Server | None = None) -> None:
        live = [s for s in self._servers if s.alive and not s.draining]
        candidates = [s for s in live if s is not avoid] or live
        if not candidates:
            if self._none_live_since is None:
                self._none_live_since = time.monotonic()
            self._parked.append(request)
            return
        server = min(candidates, key=lambda s: len(s.in_flight))
        if not server.in_flight:  # idle until now: the stall window starts with this work
            server.progress_at = time.monotonic()
        server.in_flight[request.request_id] = request
        server.busy.add()
        server.outbox.put_nowait(request)

    def _resolve(self, request_id: str, group=None, error: BaseException | None = None) -> None:
        future = self._futures.pop(request_id, None)
        self._attempts.pop(request_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(group)

    async def _read(self, server: _Server, call) -> None:
        try:
            async for group in call:
                self._on_group(server, group)
        except asyncio.CancelledError:
            return
        except grpc.aio.AioRpcError as e:
            reason = f"stream failed: {e.code().name}: {e.details()}"
            pings_refused = "too many pings" in (e.details() or "").lower()
            if pings_refused:  # the server's fault, not its groups'
                server.pings_refused += 1
                log.error("rollout server %s refuses the trainer's keepalive pings (a server "
                          "older than the trainer, or a proxy between them): upgrade it, or "
                          "set rollout.keepalive_s to 300 or more", server.address)
                if server.pings_refused >= self.options.max_attempts:
                    self._shut_out(server, f"ended {server.pings_refused} connections for "
                                           "pings")
            if pings_refused:
                self._mark_dead(server, reason)
            else:
                self._leave_failing(server, reason, charge=True)
            return
        self._leave_failing(server, "the server closed its stream", charge=True)

    def _leave_failing(self, server: _Server, reason: str, charge: bool = False) -> None:
        """Take ``server`` out of the pool for going away (``_mark_dead``); one that goes away
        before it completes a group since it joined, holding groups or within
        ``rejoin_interval_s`` of joining, is struck (``_strike``): a server that fails at once
        each time it rejoins must not cycle in and out for the rest of the run (an idle one
        cut off later is not failing at its work)."""
        at_once = time.monotonic() - server.joined_at < self.options.rejoin_interval_s
        if not server.completed and (server.in_flight or at_once):
            self._strike(server, reason, charge=charge)
        else:
            self._mark_dead(server, reason, charge=charge)

    def withdraw(self, request_ids) -> None:
        """Stop waiting for ``request_ids``: each future is cancelled and the server holding
        the request is told to stop generating it (nothing comes back for it)."""
        withdrawn = set()
        for request_id in request_ids:
            future = self._futures.pop(request_id, None)
            self._attempts.pop(request_id, None)
            if future is not None:
                future.cancel()
                withdrawn.add(request_id)
        self._parked = [r for r in self._parked if r.request_id not in withdrawn]
        for server in [*self._servers, *self._leaving.values()]:
            mine = [r for r in withdrawn if r in server.in_flight]
            for request_id in mine:
                del server.in_flight[request_id]
                server.busy.remove()
                server.outbox.put_nowait(pb.RolloutRequest(request_id=request_id, cancel=True))
            if mine:
                self._leave_if_done(server)

    def _on_group(self, server: _Server, group: pb.TrajectoryGroup) -> None:
        if group.error.draining:
            self._on_draining(server, group.request_id)
        else:
            self._take_group(server, group)
        self._leave_if_done(server)

    def _leave_if_done(self, server: _Server) -> None:
        """A draining or unlisted ``server`` leaves the pool once nothing of it is in flight."""
        if not server.in_flight:
            if server.draining:
                self._mark_dead(server, "draining, nothing of it in flight")
            elif id(server) in self._leaving:
                self._mark_dead(server, "unlisted, its last group back")

    def _on_draining(self, server: _Server, request_id: str) -> None:
        """``server`` takes no new work: route none to it; the request it turned away (if
        any; it ran none of it) goes elsewhere, not counted as a failed send."""
        if not server.draining:
            server.draining = True
            log.warning("rollout server %s is draining: it gets no new work and leaves the pool "
                        "once its %d groups are back", server.address, len(server.in_flight))
        request = server.in_flight.pop(request_id, None)
        if request is None:
            return
        server.busy.remove()
        if request_id in self._futures:  # still awaited; nothing of it was generated
            self._route(request, avoid=server)

    def _take_group(self, server: _Server, group: pb.TrajectoryGroup) -> None:
        request = server.in_flight.pop(group.request_id, None)
        if request is None:
            return  # already sent elsewhere
        server.busy.remove()
        server.progress_at = time.monotonic()
        if group.request_id not in self._futures:
            return
        code = group.error.code if group.HasField("error") else 0
        problem = None if code else group_problem(request, group, vocab_size=server.vocab_size,
                                                  newest_version=self._newest_version)
        aborted = any(t.finish_reason == pb.FINISH_REASON_ABORT for t in group.trajectories)
        if code in _SERVER_GONE or aborted:
            # The server is going away (shutting down, engine dead): it gets no more work
            # until it answers SERVING again. The request that says so is charged a failure:
            # one that takes down every server it is sent to must not cycle forever.
            reason = (f"{_code_enum(code).name}: {group.error.message}" if code
                      else "ABORT: partial samples of a shutdown")
            if not self._failed_for_good(group.request_id, server, reason):
                server.in_flight[group.request_id] = request  # resubmitted with the others
                server.busy.add()
            self._leave_failing(server, reason)
        elif code in _SERVER_FAULT or problem is not None:
            reason = (f"{_code_enum(code).name}: {group.error.message}" if code
                      else f"the group it sent back is malformed: {problem}")
            server.faults.add(group.request_id)
            if reason != server.fault_error:  # once while the same fault repeats
                log.warning("request %s failed on %s (%s); sending it again", group.request_id,
                            server.address, reason)
                server.fault_error = reason
            if not self._failed_for_good(group.request_id, server, reason):
                self.resubmitted += 1
                self._route(request, avoid=server)
            if len(server.faults) >= self.options.max_attempts:
                # It answers at once, so least-loaded routing would send it most new groups.
                self._strike(server, f"{len(server.faults)} groups in a row failed there, the "
                                     f"last: {reason}")
        else:
            server.strikes, server.fault_error, server.completed = 0, None, True
            server.faults.clear()
            if code:  # the request's own error, named with its server (whose setup may be why)
                group.error.message += f" (rollout server {server.address})"
            self._resolve(group.request_id, group)

    def _failed_for_good(self, request_id: str, server: _Server, reason: str) -> bool:
        """Count one failed send of ``request_id``; at ``max_attempts`` its future fails with
        ``RequestFailedError`` and this returns True."""
        self._attempts[request_id] += 1
        if self._attempts[request_id] < self.options.max_attempts:
            return False
        self._resolve(request_id, error=RequestFailedError(
            f"request {request_id} failed {self.options.max_attempts} times on the rollout "
            f"servers; last error from {server.address}: {reason}"))
        return True

    # ---- supervision ---------------------------------------------------------------------
    async def _supervise(self) -> None:
        """Let dead servers rejoin; fail waiting requests when none has come back in time."""
        opts = self.options
        while True:
            await asyncio.sleep(opts.rejoin_interval_s)
            now = time.monotonic()
            for server in self._servers:  # one try per server at a time; a slow one holds no other
                if (not server.alive and server.address not in self._rejoining
                        and now >= server.next_rejoin):
                    task = asyncio.create_task(self._try_rejoin(server))
                    self._rejoining[server.address] = task
                    task.add_done_callback(lambda _, a=server.address: self._rejoining.pop(a))
            for server in [*self._servers, *self._leaving.values()]:
                if (server.alive and server.in_flight and server.address not in self._stall_checks
                        and now - server.progress_at >= opts.stall_timeout_s):
                    task = asyncio.create_task(self._check_progress(server))
                    self._stall_checks[server.address] = task
                    task.add_done_callback(lambda _, a=server.address: self._stall_checks.pop(a))
            if any(s.alive for s in [*self._servers, *self._leaving.values()]):
                if self._none_live_since is not None:  # reachable, if draining: the wait for
                    self._none_live_since = now  # a server starts once the last one has left
            elif self._none_live_since is not None:
                waited = time.monotonic() - self._none_live_since
                if waited >= opts.no_server_timeout_s and self._futures:
                    why = "; ".join(f"{s.address}: {s.rejoin_error}" for s in self._servers
                                    if s.rejoin_error)
                    error = NoLiveServerError(
                        f"no rollout server has been in the pool for {waited:.0f} s "
                        f"(rollout.no_server_timeout_s); tried "
                        f"{', '.join(self.addresses) or 'none: rollout.addresses_file lists none'}"
                        + (f"; the last errors: {why}" if why else ""))
                    self._parked.clear()
                    for rid in list(self._futures):
                        self._resolve(rid, error=error)

    async def _follow_addresses_file(self) -> None:
        """Every ``rejoin_interval_s``, read ``addresses_file`` (off the event loop: a hung
        filesystem stalls only this task) and bring the pool to what it lists
        (``_apply_listing``). A file that cannot be read or has a bad line changes nothing (an
        error in the log, once per distinct problem)."""
        path, unlisted = self._addresses_file, set()
        while True:
            await asyncio.sleep(self.options.rejoin_interval_s)
            try:  # a small file, read whole each time: no edit is missed, however quick
                listed = await asyncio.to_thread(read_addresses_file, path)
            except (OSError, ValueError) as e:
                problem = _reason(e)
                if problem != self._file_problem:
                    log.error("rollout.addresses_file: %s; the pool keeps its servers (%s)",
                              problem, ", ".join(self.addresses) or "none")
                self._file_problem = problem
                continue
            self._file_problem = None
            unlisted = self._apply_listing(listed, unlisted)

    def _apply_listing(self, listed: list[str], unlisted: set[str]) -> set[str]:
        """Add the servers ``listed`` that the pool lacks; take out those missing from both
        this listing and the one before (``unlisted``: a file caught half written, truncated
        before its new lines, loses no server). Returns the servers missing from this one."""
        path = self._addresses_file
        wanted = self._fixed + [a for a in listed if a not in self._fixed]
        missing = {s.address for s in self._servers if s.address not in wanted}
        for server in [s for s in self._servers if s.address in missing & unlisted]:
            self._servers.remove(server)
            for tasks in (self._rejoining, self._stall_checks):
                if server.address in tasks:
                    tasks[server.address].cancel()
            if server.alive and server.in_flight:  # no new work; what it holds finishes there
                self._leaving[id(server)] = server
                log.warning("rollout server %s is no longer listed in %s: it gets no new work "
                            "and leaves the pool once its %d groups are back", server.address,
                            path, len(server.in_flight))
            elif server.alive:
                self._mark_dead(server, f"no longer listed in {path}")
            else:
                log.warning("rollout server %s is no longer listed in %s", server.address, path)
        present = set(self.addresses)
        for address in wanted:
            back = [s for s in self._leaving.values() if s.address == address and s.alive]
            if back:  # listed again before it left: it stays, one stream to one server
                self._servers.append(self._leaving.pop(id(back[0])))
                log.warning("rollout server %s is listed again in %s; it stays in the pool",
                            address, path)
                self._route_parked()
            elif address not in present:
                self._servers.append(_Server(address))
                log.warning("rollout server %s was added to the pool (%s); it gets work once "
                            "it answers and has the current weights", address, path)
        return missing

    def _hold_back(self, server: _Server, failures: int, what: str, error: str) -> None:
        """After ``failures`` in a row, ``server`` rejoins no sooner than twice as long per
        failure (at most ``max_rejoin_backoff_s``); after ``max_attempts``, only once it is
        restarted (``_shut_out``)."""
        opts = self.options
        server.next_rejoin = time.monotonic() + min(opts.rejoin_interval_s * 2 ** failures,
                                                    opts.max_rejoin_backoff_s)
        if failures >= opts.max_attempts:
            self._shut_out(server, f"{what} {failures} times in a row: {error}")

    def _shut_out(self, server: _Server, why: str) -> None:
        """Keep ``server``'s process out of the pool for the rest of the run; once the server
        is restarted (its status names another process) it may rejoin. A server whose status
        names no process stays out for good."""
        server.rejoin_error = why  # named if the run stops for want of servers
        if server.instance:  # asked no more often than a server that is down
            server.shut_out = server.instance
            server.next_rejoin = time.monotonic() + self.options.rejoin_interval_s
            log.error("rollout server %s %s; it stays out of the pool until it is restarted",
                      server.address, why)
        else:
            server.next_rejoin = math.inf
            log.error("rollout server %s %s; it stays out of the pool for the rest of the run",
                      server.address, why)

    async def _check_progress(self, server: _Server) -> None:
        """``server`` has had groups in flight and sent none back for ``stall_timeout_s``: keep
        it if it generated tokens since it was last asked (or is paused, or its engine counts
        tokens only as sequences end), else take it out of the pool, its groups charged a
        failed send (a server that accepts work and never answers, its process alive, held them
        for good: a wedged engine, a stuck device)."""
        try:
            status = await server.stub.GetStatus(pb.GetStatusRequest(),
                                                 timeout=self.options.rpc_timeout_s,
                                                 metadata=self._metadata)
        except (grpc.aio.AioRpcError, AttributeError):  # AttributeError: it left meanwhile
            status = None
        if not server.alive or time.monotonic() - server.progress_at < self.options.stall_timeout_s:
            return  # it left, or a group came back meanwhile
        if status is not None and status.paused and not self._paused:
            try:  # paused, not by this run (a lost resume): resumed, its window starts again
                await self._match_pause(server.address, server.stub, status)
            except (grpc.aio.AioRpcError, AttributeError):
                status = None
        if status is not None and (status.paused or status.tokens_generated > server.tokens_seen
                                   or not status.engine_stats.get("tokens_as_generated", 1.0)):
            # paused by this run, progressing, or its count moves only as sequences end
            # (SGLang): kept
            server.progress_at, server.tokens_seen = time.monotonic(), status.tokens_generated
            return
        self._strike(server, f"no group back and no token generated for "
                             f"{self.options.stall_timeout_s:g} s with {len(server.in_flight)} "
                             "groups in flight (rollout.stall_timeout_s)", charge=True)

    def _strike(self, server: _Server, reason: str, charge: bool = False) -> None:
        """Take ``server`` out of the pool for failing at its work (``_mark_dead``), to rejoin
        after a backoff that doubles with each such strike in a row (a group it completes
        ends the row)."""
        self._mark_dead(server, reason, charge=charge)
        server.faults.clear()
        server.fault_error = None
        server.strikes += 1
        self._hold_back(server, server.strikes, "was taken out of the pool", reason)

    @property
    def addresses(self) -> list[str]:
        """Every server of the pool, in the pool or out of it for now."""
        return [s.address for s in self._servers]

    async def _try_rejoin(self, server: _Server) -> None:
        channel = self._new_channel(server.address)
        timeout = min(self.options.rpc_timeout_s, max(1.0, self.options.rejoin_interval_s))
        serving_health = False
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout,
                metadata=self._metadata)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                raise ConnectionError("not serving")
            serving_health = True
            stub = pb_grpc.RolloutServiceStub(channel)
            status = await stub.GetStatus(pb.GetStatusRequest(), timeout=timeout,
                                          metadata=self._metadata)
            if status.draining:  # stopping: tried again while it is up
                await channel.close()
                server.next_rejoin = time.monotonic() + self.options.rejoin_interval_s
                return
            if server.shut_out is not None:
                if status.instance_id == server.shut_out:  # the same process: still out
                    await channel.close()
                    server.next_rejoin = time.monotonic() + self.options.rejoin_interval_s
                    return
                log.warning("rollout server %s was restarted; it may rejoin the pool",
                            server.address)
                server.shut_out, server.rejoin_error = None, None
                server.strikes = server.rejoin_failures = server.pings_refused = 0
            elif server.instance and status.instance_id != server.instance:
                server.strikes = 0  # another process: the strikes were the one before's
            server.instance, server.vocab_size = status.instance_id, status.vocab_size
            if self._admit is not None:
                try:
                    self._admit(server.address, status)
                except ValueError as e:
                    self._shut_out(server, f"cannot serve this run: {e}")
                    await channel.close()
                    return
            serving = status.version
            # The weights go over without the lock, so publishing never waits for a server
            # that may take long to load, or hang. A version published meanwhile is loaded
            # under the lock (that server has just loaded one): with versions published
            # faster than it loads, it would otherwise load again and again, never rejoining.
            w, first_load_s = self._weights, 0.0
            if w is not None and serving != w.version:
                started = time.monotonic()
                try:
                    with export_in_use(w.path):  # not pruned while the server reads it
                        await self._send_weights(stub, w, force=True)
                    serving = w.version
                except FileNotFoundError:  # pruned before: a newer version was published
                    if self._weights is w:
                        raise
                first_load_s = time.monotonic() - started
                if serving == w.version:
                    server.load_s = first_load_s
            async with self._weights_lock:
                w = self._weights
                if w is not None and serving != w.version:  # publishing waits: bounded
                    timeout = min(self.options.update_timeout_s, max(
                        self.options.rpc_timeout_s, STRAGGLER_FACTOR * first_load_s))
                    with export_in_use(w.path):
                        await self._send_weights(stub, w, force=True, timeout=timeout)
                    serving = w.version
                await self._match_pause(server.address, stub, status)
                server.version = serving
                self._open(server, channel)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, ConnectionError, OSError) as e:
            # A server that is down says so every try (debug); one that answers SERVING but
            # fails to take the weights is worth a warning, once per distinct error.
            error = f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"
            if not serving_health:
                log.debug("rollout server %s cannot rejoin yet: %s", server.address, error)
            elif error != server.rejoin_error:
                log.warning("rollout server %s answers SERVING but cannot rejoin: %s",
                            server.address, error)
            if serving_health:  # it takes weights each try: wait longer after each failure
                server.rejoin_error = error
                server.rejoin_failures += 1
                self._hold_back(server, server.rejoin_failures, "failed to take the weights",
                                error)
            await channel.close()
            return
        except asyncio.CancelledError:  # the pool is closing
            await channel.close()
            raise
        server.rejoin_error, server.rejoin_failures = None, 0
        log.warning("rollout server %s rejoined the pool at version %s", server.address,
                    server.version)

    # ---- control calls -------------------------------------------------------------------
    async def _control(self, server: _Server, name: str, call, timeout: float):
        """``await call(stub, timeout)`` with retries; None when the server had to leave."""
        for attempt in range(self.options.rpc_retries + 1):
            if not server.alive:
                return None
            try:
                return await call(server.stub, timeout)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this task is being cancelled
                # The call's channel was closed under it: the server left the pool meanwhile.
                self._mark_dead(server, f"{name}: cancelled with its channel")
                return None
            except grpc.aio.AioRpcError as e:
                if e.code() == _S.UNAVAILABLE and attempt < self.options.rpc_retries:
                    await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
                    continue
                if e.code() in (_S.UNAVAILABLE, _S.DEADLINE_EXCEEDED, _S.CANCELLED):
                    self._mark_dead(server, f"{name}: {e.code().name}: {e.details()}")
                    return None
                raise
        return None

    def _reachable(self) -> list[_Server]:
        """The servers control calls go to: those in the pool and those leaving it."""
        return [s for s in [*self._servers, *self._leaving.values()] if s.alive]

    async def _each(self, name: str, call, timeout: float,
                    return_exceptions: bool = False) -> list:
        """``(server, result)`` of ``call`` on every live server; servers that fail it leave
        the pool (``return_exceptions``: other errors are results, as ``asyncio.gather``)."""
        servers = self._reachable()
        results = await asyncio.gather(*(self._control(s, name, call, timeout) for s in servers),
                                       return_exceptions=return_exceptions)
        return [(s, r) for s, r in zip(servers, results) if r is not None]

    def _straggler_deadline(self, server: _Server, half_s: float) -> float:
        """Seconds after a publish started by which ``server`` must have loaded it, once half
        the servers have (by ``half_s``): ``STRAGGLER_FACTOR`` times that or its own last load,
        at least ``rpc_timeout_s``."""
        return max(self.options.rpc_timeout_s, STRAGGLER_FACTOR * max(half_s, server.load_s))

    async def _load_everywhere(self, call) -> list:
        """``_each`` for a weight update: once half the servers have loaded the version, a
        server still loading past its ``_straggler_deadline`` leaves the pool (its groups go to
        the others; it rejoins once it has loaded the newest weights), so one slow or hung
        server does not hold every publish up to ``update_timeout_s``. Half, not the fastest:
        loads queued on one shared disk end one after another, the last in line no straggler."""
        servers = self._reachable()
        started = time.monotonic()
        tasks = {asyncio.ensure_future(self._control(
            s, "update weights", call, self.options.update_timeout_s)): s for s in servers}
        pending, loaded, half_s = set(tasks), 0, None
        try:
            while pending:
                wait_s = None
                if half_s is not None:
                    deadline = min(self._straggler_deadline(tasks[t], half_s) for t in pending)
                    wait_s = max(0.0, started + deadline - time.monotonic())
                done, pending = await asyncio.wait(pending, timeout=wait_s,
                                                   return_when=asyncio.FIRST_COMPLETED)
                elapsed = time.monotonic() - started
                for task in done:
                    if (not task.cancelled() and task.exception() is None
                            and task.result() is not None):
                        tasks[task].load_s = elapsed
                        loaded += 1
                if half_s is None and 2 * loaded >= len(servers):
                    half_s = elapsed
                if half_s is None:
                    continue
                for task in list(pending):
                    server = tasks[task]
                    allowed = self._straggler_deadline(server, half_s)
                    if elapsed >= allowed:
                        self._mark_dead(server, f"still loading the new weights {allowed:.0f} s "
                                                f"into the publish, half the servers had them "
                                                f"after {half_s:.1f} s; it rejoins once loaded")
                        task.cancel()
                        pending.discard(task)
        finally:  # also when this publish is cancelled: no load call outlives it
            for task in pending:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        results = []
        for task, server in tasks.items():
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:
                results.append((server, error))
            elif task.result() is not None:
                results.append((server, task.result()))
        return results

    async def _send_weights(self, stub, w: _Weights, force: bool, timeout: float | None = None):
        timeout = timeout or self.options.update_timeout_s
        if w.push:
            chunks = push_weight_requests(w.path, w.version, force=force)
            return await stub.PushWeights(_read_off_loop(chunks),
                                          timeout=timeout, metadata=self._metadata)
        request = pb.UpdateWeightsRequest(path=w.path, version=w.version, force=force)
        return await stub.UpdateWeights(request, timeout=timeout, metadata=self._metadata)

    async def update_weights(self, path: str | Path, version: int, push: bool = False,
                             force: bool = False) -> None:
        """Every live server loads the HF directory ``path`` as ``version`` (``push``: the files
        are streamed to the server instead of read from a shared filesystem; ``force``: also
        when a server serves a newer version, as after a restart from an older checkpoint). A
        relative ``path`` is sent absolute: a server would read it from its own directory."""
        w = _Weights(os.path.abspath(path), version, push)
        if force or self._newest_version == _NO_VERSION_YET:  # servers go to it, whatever
            self._newest_version = version  # they served (a new run starts from its own)
        else:  # set before any server loads it: its first tokens are not taken for future
            self._newest_version = max(self._newest_version, version)

        async def one(stub, timeout):
            try:
                return await self._send_weights(stub, w, force, timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in (_S.UNAVAILABLE, _S.DEADLINE_EXCEEDED, _S.CANCELLED):
                    raise  # the server, not the weights: _control takes it out
                raise WeightsRejectedError(f"a rollout server refused version {version} at "
                                           f"{path}: {e.code().name}: {e.details()}") from e

        async with self._weights_lock:
            done = await self._load_everywhere(one)
            for _, result in done:
                if isinstance(result, BaseException) and not isinstance(
                        result, WeightsRejectedError):
                    raise result
            took = [s for s, r in done if not isinstance(r, BaseException)]
            refused = [(s, r) for s, r in done if isinstance(r, WeightsRejectedError)]
            if refused and not took:
                # No live server took it (the others, if any, left on timeouts): the export
                # itself is bad, or every server's setup is; either way nothing can serve it.
                raise refused[0][1]
            for server, error in refused:  # it rejoins with a forced load of these weights
                self._mark_dead(server, str(error))
            for server in took:
                server.version = version
            self._weights = w

    def record_weights(self, path: str | Path, version: int, push: bool = False) -> None:
        """Every server already serves ``path`` as ``version`` (launched with it): servers
        that rejoin later are brought to it."""
        self._weights = _Weights(os.path.abspath(path), version, push)
        self._newest_version = version
        for server in self._servers:
            server.version = version

    async def pause(self) -> None:
        """Pause every server; servers that join meanwhile are paused as they join."""
        self._paused = True
        await self._each("pause", lambda stub, t: stub.Pause(
            pb.PauseRequest(), timeout=t, metadata=self._metadata), self.options.rpc_timeout_s)

    async def resume(self) -> None:
        """Resume every server; servers that join meanwhile are resumed as they join."""
        self._paused = False
        await self._each("resume", lambda stub, t: stub.Resume(
            pb.ResumeRequest(), timeout=t, metadata=self._metadata), self.options.rpc_timeout_s)

    async def statuses(self) -> dict[str, pb.ServerStatus]:
        """Each live server's status, by address (servers failing the call leave the pool)."""
        done = await self._each("status", lambda stub, t: stub.GetStatus(
            pb.GetStatusRequest(), timeout=t, metadata=self._metadata), self.options.rpc_timeout_s)
        return {server.address: status for server, status in done}

    async def close(self) -> None:
        """Release the servers (``Release``: another run may load its weights at once), close
        every stream and channel; futures still waiting are cancelled."""
        tasks = [t for t in (self._supervisor, self._follower) if t is not None]
        tasks += [*self._rejoining.values(), *self._stall_checks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        live = self._reachable()
        if self._paused:  # a run stopped while they were paused: they generate for the next
            await asyncio.gather(*(s.stub.Resume(
                pb.ResumeRequest(), timeout=min(self.options.rpc_timeout_s, _RELEASE_S),
                metadata=self._metadata) for s in live), return_exceptions=True)
        if self._run_id:  # a server that cannot be told frees itself after its run_lease_s
            await asyncio.gather(*(s.stub.Release(
                pb.ReleaseRequest(), timeout=min(self.options.rpc_timeout_s, _RELEASE_S),
                metadata=self._metadata) for s in live), return_exceptions=True)
        for server in [*self._servers, *self._leaving.values()]:
            if server.alive:
                server.alive = False
                server.outbox.put_nowait(None)
                server.call.cancel()
                server.reader.cancel()
                await asyncio.gather(server.reader, return_exceptions=True)
                await server.channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
        for future in self._futures.values():
            if not future.done():
                future.cancel()
        self._futures.clear()
        self._parked.clear()


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def _code_enum(number: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)


async def _read_off_loop(iterator):
    """Yield from a blocking iterator (file reads) without blocking the event loop."""
    done = object()
    while (item := await asyncio.to_thread(next, iterator, done)) is not done:
        yield item
