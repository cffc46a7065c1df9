"""The standard gRPC health service, bounded: it answers without the shared token (load
balancers and orchestrators probe it), so what a caller can make it hold must not grow with
the number of calls."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health

MAX_WATCHERS = 64  # Watch streams open at once; probes use Check, orchestrators a few Watches


class BoundedHealthServicer(health.aio.HealthServicer):
    """``Check`` and ``Watch`` as gRPC defines them, with at most ``max_watchers`` Watch
    streams open at once (one more is refused RESOURCE_EXHAUSTED)."""

    def __init__(self, max_watchers: int = MAX_WATCHERS):
        super().__init__()
        self.max_watchers = max_watchers
        self.num_watchers = 0

    async def Watch(self, request, context) -> None:
        if self.num_watchers >= self.max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server has {self.max_watchers} health Watch streams open, its most; "
                "use Check, or close a Watch")
        self.num_watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.num_watchers -= 1
