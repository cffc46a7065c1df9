"""SIGTERM (``kill``, ``scancel``, ``docker stop``) as a graceful stop, like Ctrl-C.

Outside an event loop it raises ``KeyboardInterrupt`` where the main thread is; inside one
(``run_stoppable``) it cancels the main task, so the loop's own machinery is never interrupted
half way, and ``KeyboardInterrupt`` is raised once the task has unwound. Neither depends on
SIGINT's disposition: a background job of a script starts with SIGINT ignored, and a SIGTERM
turned into SIGINT was then dropped.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_running: tuple[asyncio.AbstractEventLoop, Callable[[], Any]] | None = None  # run_stoppable's


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM stops this process as Ctrl-C does (main thread only)."""
    signal.signal(signal.SIGTERM, _interrupt)


def run_stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``; after ``stop_on_sigterm``, a SIGTERM cancels the main task and
    ``KeyboardInterrupt`` is raised once it has unwound and the loop is closed. Later SIGTERMs
    change nothing: the unwinding (servers stopped, checkpoint writes finished) goes on."""
    if signal.getsignal(signal.SIGTERM) is not _interrupt:
        return asyncio.run(coro)
    stopped = False

    def note(signum=None, frame=None) -> bool:
        nonlocal stopped
        first, stopped = not stopped, True
        return first

    async def main() -> T:
        global _running
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        _running = (loop, lambda: note() and task.cancel())
        loop.add_signal_handler(signal.SIGTERM, _running[1])
        try:
            return await coro
        except asyncio.CancelledError:
            if not stopped:
                raise
            return None
        finally:
            _running = None
            loop.remove_signal_handler(signal.SIGTERM)  # which leaves SIGTERM at SIG_DFL
            signal.signal(signal.SIGTERM, note)  # while the loop closes: noted, nothing raised

    try:
        result = asyncio.run(main())
    finally:
        stop_on_sigterm()
    if stopped:
        raise KeyboardInterrupt
    return result


def stop_the_running() -> bool:
    """From any thread: stop the ``run_stoppable`` run in progress as a SIGTERM would. False
    when none is (not started, or already unwinding its loop)."""
    running = _running
    if running is None:
        return False
    try:
        running[0].call_soon_threadsafe(running[1])
    except RuntimeError:  # its loop closed meanwhile
        return False
    return True
