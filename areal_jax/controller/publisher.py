"""Publishing new versions off the trainer's critical path.

After a train step the trainer takes a host snapshot of its parameters (cheap: a device-to-host
copy); writing the files and delivering them to every rollout server then runs here, in a
background task, while the trainer already trains the next version. Versions are published in
order, one at a time; when the trainer gets ahead, only the newest waiting snapshot is
published (servers need the newest weights, not every version), though a superseded snapshot
that is ``kept`` (for an accuracy curve after the run) is still written. The staleness gate
counts from ``published`` (the version the servers confirmed), so a publish that lags makes the
gate tighter, never looser. While ``hold()`` is in effect (an evaluation of the served version
runs) nothing newer is published; ``release()`` publishes the newest snapshot submitted meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class Publisher:
    """Serialises ``snapshot.write()`` + ``pool.update_weights`` for each submitted snapshot.

    ``snapshot`` is any object with ``version`` and ``write() -> Path`` (a blocking call, run
    on a worker thread), and optionally ``kept`` (written even when superseded).
    ``on_published(version, timings)`` runs after every server has it.
    """

    def __init__(self, pool, published: int, push: bool = False,
                 on_published: Callable[[int, dict], None] | None = None):
        self._pool = pool
        self._push = push
        self._on_published = on_published
        self.published = published
        self.skipped = 0  # versions superseded before they were written
        self.last_timings: dict[str, float] = {}
        self._pending = None
        self._superseded_kept: list = []  # written, not delivered, before the next publish
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._held = False
        self._task = asyncio.create_task(self._run())

    def submit(self, snapshot) -> None:
        """Publish ``snapshot`` when the one in progress is delivered (replacing a waiting one)."""
        self.raise_error()
        if self._pending is not None:
            self.skipped += 1
            if getattr(self._pending, "kept", False):
                self._superseded_kept.append(self._pending)
        self._pending = snapshot
        self._idle.clear()
        self._wake.set()

    def hold(self) -> None:
        """Publish nothing more until ``release()``: the servers keep the version they serve
        (after ``flush()``, the newest submitted), for an evaluation of it."""
        self._held = True

    def release(self) -> None:
        """End ``hold()``: the newest snapshot submitted meanwhile is published."""
        self._held = False
        self._wake.set()

    def raise_error(self) -> None:
        """Re-raise a failure of the background task (it stops publishing after one)."""
        if self._error is not None:
            raise self._error
        if self._task.done():
            raise RuntimeError("the publishing task ended unexpectedly")

    async def flush(self) -> None:
        """Wait until every submitted snapshot is published (or has been superseded); while
        held, those submitted since wait for ``release()``."""
        idle = asyncio.ensure_future(self._idle.wait())
        await asyncio.wait({idle, self._task}, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        self.raise_error()

    async def publish_now(self, snapshot) -> None:
        """Publish ``snapshot`` and wait for it (the synchronous mode's path)."""
        self.submit(snapshot)
        await self.flush()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._held:  # the snapshot waits, replaced by newer ones, for release()
                continue
            snapshot, self._pending = self._pending, None
            if snapshot is None:
                continue
            try:
                # Older than ``snapshot``, in version order (ones superseded meanwhile are
                # newer: they wait for the next round).
                kept, self._superseded_kept = self._superseded_kept, []
                for older in kept:
                    await asyncio.to_thread(older.write)
                t0 = time.monotonic()
                path: Path = await asyncio.to_thread(snapshot.write)
                t1 = time.monotonic()
                await self._pool.update_weights(path, snapshot.version, push=self._push)
                t2 = time.monotonic()
                self.published = snapshot.version
                self.last_timings = {"timing/export_s": t1 - t0, "timing/deliver_s": t2 - t1}
                if self._on_published is not None:  # its failure (a full disk) is ours
                    self._on_published(snapshot.version, self.last_timings)
            except (Exception, asyncio.CancelledError) as e:  # surfaced by raise_error/flush
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # close()
                log.error("publishing version %d failed: %r", snapshot.version, e)
                self._error = e if isinstance(e, Exception) else RuntimeError(
                    f"publishing version {snapshot.version} was cancelled")
                self._idle.set()
                return
            if self._pending is None:
                self._idle.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
