"""Bounded admission of requests: a queue of waiting groups in front of the running slots.

``reserve`` waits while queue and slots are all taken (the Rollout stream stops reading, so
gRPC flow control pushes back on the client); ``start`` waits for a running slot. After
``close`` both raise ``AdmissionClosed`` so queued work can be returned as aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class AdmissionClosed(Exception):
    """The server is shutting down and admits nothing more."""


class Admission:
    """Counts queued and running requests against ``max_queued`` and ``max_running``."""

    def __init__(self, max_queued: int, max_running: int):
        self.max_queued = max_queued
        self.max_running = max_running
        self.queued = 0
        self.running = 0
        self.closed = False
        self._waiters: set[asyncio.Future] = set()

    async def reserve(self) -> None:
        """Take a place in the queue, waiting while queue and slots are full."""
        await self._wait_until(
            lambda: self.queued + self.running < self.max_queued + self.max_running
        )
        self.queued += 1

    async def start(self) -> None:
        """Move a reserved request from the queue to a running slot."""
        await self._wait_until(lambda: self.running < self.max_running)
        self.queued -= 1
        self.running += 1

    def release(self, started: bool) -> None:
        """Give back the request's place (its slot if ``started``, else its queue place)."""
        if started:
            self.running -= 1
        else:
            self.queued -= 1
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
