"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, for the system calls Python does not wrap (prctl, mount, unshare); load
    it before forking."""
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child before exec: receive ``sig`` when the thread that started it ends, even if
    that process was SIGKILLed. Exits at once if this cannot be armed or ``parent`` is already
    gone. Elsewhere than Linux it does nothing."""
    if sys.platform != "linux":
        return
    if libc().prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(1)
