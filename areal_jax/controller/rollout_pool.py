"""Client side of N rollout servers: one open ``Rollout`` stream each, least-loaded routing,
resubmission when a server dies, and weight updates broadcast to every live server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import grpc

from areal_jax.protocol import push_weight_requests
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.protocol.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class NoLiveServerError(RuntimeError):
    """Every rollout server has failed; nothing can be generated."""


@dataclasses.dataclass
class _Server:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.RolloutServiceStub
    outbox: asyncio.Queue
    in_flight: dict[str, pb.RolloutRequest] = dataclasses.field(default_factory=dict)
    alive: bool = True
    reader: asyncio.Task | None = None


class RolloutPool:
    """Routes rollout requests to the least-loaded live server; each ``submit`` returns a future
    resolved with the server's ``TrajectoryGroup`` (or its per-request error)."""

    def __init__(self, addresses: list[str], auth_token: str | None = None,
                 tls_root_cert: bytes | None = None, max_message_mb: int = 64):
        if not addresses:
            raise ValueError("rollout.addresses: at least one rollout server is needed")
        self._addresses = list(addresses)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._tls = tls_root_cert
        self._options = [("grpc.max_send_message_length", max_message_mb << 20),
                         ("grpc.max_receive_message_length", max_message_mb << 20)]
        self._servers: list[_Server] = []
        self._futures: dict[str, asyncio.Future] = {}

    async def start(self, ready_timeout_s: float = 120.0) -> None:
        """Connect to every server (waiting until each answers) and open the streams."""
        for address in self._addresses:
            if self._tls is not None:
                channel = grpc.aio.secure_channel(
                    address, grpc.ssl_channel_credentials(self._tls), options=self._options)
            else:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            await asyncio.wait_for(channel.channel_ready(), ready_timeout_s)
            server = _Server(address, channel, pb_grpc.RolloutServiceStub(channel), asyncio.Queue())
            server.reader = asyncio.create_task(self._read(server))
            self._servers.append(server)

    @property
    def live_servers(self) -> list[str]:
        return [s.address for s in self._servers if s.alive]

    def in_flight(self) -> int:
        return len(self._futures)

    def submit(self, request: pb.RolloutRequest) -> asyncio.Future:
        """Send ``request`` to the least-loaded live server; the future gets its group."""
        if request.request_id in self._futures:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        future = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = future
        self._route(request)
        return future

    def _route(self, request: pb.RolloutRequest, avoid: _Server | None = None) -> None:
        live = [s for s in self._servers if s.alive and s is not avoid]
        if not live:
            error = NoLiveServerError("every rollout server has failed")
            for rid, future in list(self._futures.items()):
                if not future.done():
                    future.set_exception(error)
            self._futures.clear()
            return
        server = min(live, key=lambda s: len(s.in_flight))
        server.in_flight[request.request_id] = request
        server.outbox.put_nowait(request)

    def _has_other_live(self, server: _Server) -> bool:
        return any(s.alive and s is not server for s in self._servers)

    async def _requests_of(self, server: _Server):
        while True:
            request = await server.outbox.get()
            if request is None:
                return
            yield request

    async def _read(self, server: _Server) -> None:
        call = server.stub.Rollout(self._requests_of(server), metadata=self._metadata)
        try:
            async for group in call:
                request = server.in_flight.pop(group.request_id, None)
                aborted = any(t.finish_reason == pb.FINISH_REASON_ABORT for t in group.trajectories)
                if aborted and request is not None and self._has_other_live(server):
                    # A server shutting down returns partial samples: generate them again.
                    self._route(request, avoid=server)
                    continue
                future = self._futures.pop(group.request_id, None)
                if future is not None and not future.done():
                    future.set_result(group)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not server.alive:
                return
            log.warning("rollout server %s failed (%s: %s); resubmitting its %d groups",
                        server.address, e.code().name, e.details(), len(server.in_flight))
        server.alive = False
        orphans = list(server.in_flight.values())
        server.in_flight.clear()
        for request in orphans:
            if request.request_id in self._futures:
                self._route(request)

    async def _each(self, fn):
        """``fn(server)`` on every live server; a server found unreachable is marked dead (its
        stream reader resubmits its groups) and left out of the results."""

        async def guarded(server: _Server):
            try:
                return await fn(server)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                log.warning("rollout server %s is unreachable: %s", server.address, e.details())
                server.alive = False
                return None

        servers = [s for s in self._servers if s.alive]
        results = await asyncio.gather(*(guarded(s) for s in servers))
        if not any(s.alive for s in self._servers):
            raise NoLiveServerError("every rollout server has failed")
        return [r for r in results if r is not None]

    async def update_weights(self, path: str | Path, version: int, push: bool = False) -> None:
        """Every live server loads the HF directory ``path`` as ``version`` (``push``: the files
        are streamed to the server instead of read from a shared filesystem)."""
        async def one(server: _Server):
            if push:
                await server.stub.PushWeights(push_weight_requests(path, version),
                                              metadata=self._metadata)
            else:
                await server.stub.UpdateWeights(
                    pb.UpdateWeightsRequest(path=str(path), version=version),
                    metadata=self._metadata)

        await self._each(one)

    async def pause(self) -> None:
        await self._each(lambda s: s.stub.Pause(pb.PauseRequest(), metadata=self._metadata))

    async def resume(self) -> None:
        await self._each(lambda s: s.stub.Resume(pb.ResumeRequest(), metadata=self._metadata))

    async def status(self) -> list[pb.ServerStatus]:
        return await self._each(
            lambda s: s.stub.GetStatus(pb.GetStatusRequest(), metadata=self._metadata))

    async def close(self) -> None:
        for server in self._servers:
            server.alive = False
            server.outbox.put_nowait(None)
        for server in self._servers:
            if server.reader is not None:
                server.reader.cancel()
                await asyncio.gather(server.reader, return_exceptions=True)
            await server.channel.close()
        for future in self._futures.values():
            if not future.done():
                future.cancel()
        self._futures.clear()

