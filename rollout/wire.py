"""Registers ``RolloutService`` so that a message that does not decode is INVALID_ARGUMENT;
``abort`` ends a call with a status message short enough to reach the client.

gRPC answers a request its deserializer cannot parse with UNKNOWN. Here such a message reaches
the handler as an ``InvalidParamError`` (field ``request``): a unary call fails
INVALID_ARGUMENT, and a stream raises it where the handler reads the message, so each stream
reports it the way it reports any bad message. The handlers are built from the service
descriptor, the same as the generated ``add_RolloutServiceServicer_to_server``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from areal_jax.protocol import SERVICE_NAME
from areal_jax.protocol.v1 import rollout_pb2 as pb
from rollout.engine import InvalidParamError


# gRPC sends a status message in the trailing metadata, percent-encoded (up to 3 bytes per
# byte), and a client drops trailers over 8 KiB (soft limit) or 16 KiB: a longer message (a
# client's 9000-character path quoted back) reached it as RESOURCE_EXHAUSTED "Stream removed".
MAX_STATUS_MESSAGE_BYTES = 2048


def bounded_message(message: str) -> str:
    """``message`` cut to ``MAX_STATUS_MESSAGE_BYTES`` of UTF-8, saying so."""
    raw = message.encode()
    if len(raw) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    kept = raw[:MAX_STATUS_MESSAGE_BYTES - 64].decode(errors="ignore")
    return f"{kept}... (cut: {len(raw)} bytes in all)"


async def abort(context, code: grpc.StatusCode, message: str):
    """``context.abort`` with the message bounded (``bounded_message``); raises."""
    await context.abort(code, bounded_message(message))


class _Undecodable:
    """Stands for a request message that failed to parse."""

    def __init__(self, error: DecodeError):
        self.error = InvalidParamError("request", f"the message does not decode: {error}")


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return _Undecodable(e)

    return deserialize


async def _checked(requests: AsyncIterator) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.error
        yield request


def _wrap(behaviour, client_streaming: bool, server_streaming: bool):
    """``behaviour`` with undecodable requests turned into ``InvalidParamError``."""
    if client_streaming and server_streaming:

        async def stream_stream(requests, context):
            async for item in behaviour(_checked(requests), context):
                yield item

        return grpc.stream_stream_rpc_method_handler, stream_stream
    if client_streaming:

        async def stream_unary(requests, context):
            return await behaviour(_checked(requests), context)

        return grpc.stream_unary_rpc_method_handler, stream_unary

    async def refuse(request, context):
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(request.error))

    if server_streaming:

        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            async for item in behaviour(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler, unary_stream

    async def unary_unary(request, context):
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await behaviour(request, context)

    return grpc.unary_unary_rpc_method_handler, unary_unary


def add_rollout_service(servicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer``'s methods as ``RolloutService`` on ``server``."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["RolloutService"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make, behaviour = _wrap(
            getattr(servicer, method.name), method.client_streaming, method.server_streaming
        )
        handlers[method.name] = make(
            behaviour,
            request_deserializer=_lenient(request_cls.FromString),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
