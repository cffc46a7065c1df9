"""Bounded admission of requests: a queue of waiting groups in front of the running slots.

``reserve`` waits while queue and slots are all taken, or while the requests held (queued and
running) would exceed their byte budget (the Rollout stream stops reading, so gRPC flow control
pushes back on the client); ``start`` waits for a running slot. After ``close`` both raise
``AdmissionClosed`` so queued work can be returned as aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class AdmissionClosed(Exception):
    """The server is shutting down and admits nothing more."""


class Admission:
    """Counts queued and running requests against ``max_queued`` and ``max_running``, and
    their message bytes against ``max_bytes`` (a request larger than that alone is admitted
    when nothing else is held)."""

    def __init__(self, max_queued: int, max_running: int, max_bytes: int | None = None):
        self.max_queued = max_queued
        self.max_running = max_running
        self.max_bytes = max_bytes
        self.queued = 0
        self.running = 0
        self.held_bytes = 0
        self.closed = False
        self._waiters: set[asyncio.Future] = set()

    async def reserve(self, size: int = 0) -> None:
        """Take a place in the queue for a request of ``size`` bytes, waiting while queue and
        slots are full or the bytes held would exceed ``max_bytes``."""
        def fits() -> bool:
            if self.queued + self.running >= self.max_queued + self.max_running:
                return False
            return (self.max_bytes is None or self.held_bytes == 0
                    or self.held_bytes + size <= self.max_bytes)

        await self._wait_until(fits)
        self.queued += 1
        self.held_bytes += size

    async def start(self) -> None:
        """Move a reserved request from the queue to a running slot."""
        await self._wait_until(lambda: self.running < self.max_running)
        self.queued -= 1
        self.running += 1

    def release(self, started: bool, size: int = 0) -> None:
        """Give back the place of a request of ``size`` bytes (its slot if ``started``, else
        its queue place)."""
        if started:
            self.running -= 1
        else:
            self.queued -= 1
        self.held_bytes -= size
        self._wake()

    def close(self) -> None:
        """Refuse everything from now on; waiters raise ``AdmissionClosed``."""
        self.closed = True
        self._wake()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed and not ready():
            waiter = loop.create_future()
            self._waiters.add(waiter)
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)
        if self.closed:
            raise AdmissionClosed("the server is shutting down")

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
