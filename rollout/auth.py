"""Shared-token check: every call must carry ``authorization: Bearer <token>``.

Health checks are exempt so that load balancers and orchestrators can probe without the token.
"""

from __future__ import annotations

import hmac

import grpc
from grpc_health.v1 import health

UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token in the authorization metadata"


async def _deny(request_or_iterator, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the shared bearer token (constant-time comparison)."""

    def __init__(self, token: str, exempt_services: tuple[str, ...] = (health.SERVICE_NAME,)):
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_services

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in self._exempt:
            return handler
        given = [value.encode() if isinstance(value, str) else value
                 for key, value in handler_call_details.invocation_metadata or ()
                 if key == "authorization"]
        # exactly one: with several, which one counts would be the transport's choice
        if len(given) == 1 and hmac.compare_digest(given[0], self._expected):
            return handler
        return _denying_handler(handler)
