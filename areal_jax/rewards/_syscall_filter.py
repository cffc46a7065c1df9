"""A seccomp filter for the sandbox: refuse the system calls that hold memory no limit counts.

``RLIMIT_AS`` counts what a process maps. Memory it holds without mapping it is not counted:
an anonymous memory file (``memfd_create``, ``memfd_secret``) written through ``write()``,
System V shared memory created (``shmget``), touched and detached, messages queued in System V
message queues (``msgget``; 32000 queues of 16 KiB each by default), System V semaphore sets
(``semget``). A process could hold any amount that way (within an IPC namespace, what its
limits allow). The filter makes those calls fail with ``EPERM``, as do calls
through another ABI than the native one (x86-64's x32 and i386 entries name them by other
numbers). Installed after ``PR_SET_NO_NEW_PRIVS`` (which an unprivileged process needs, and
which keeps set-uid programs from gaining privileges); inherited by every child and ``exec``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform

# Linux's numbers for the refused calls, and the audit architecture of each ABI.
_ARCHES = {
    # machine: (AUDIT_ARCH, first number of a foreign ABI sharing the arch or None, calls)
    "x86_64": (0xC000003E, 0x40000000, {"memfd_create": 319, "memfd_secret": 447,
                                        "shmget": 29, "msgget": 68, "semget": 64}),
    "aarch64": (0xC00000B7, None, {"memfd_create": 279, "memfd_secret": 447, "shmget": 194,
                                   "msgget": 186, "semget": 190}),
}
REFUSED_CALLS = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget")

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO with the errno in its low bits
_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06  # classic BPF opcodes
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # in struct seccomp_data


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def _instructions(arch: int, foreign_from: int | None, numbers: list[int]) -> list[tuple]:
    """The filter as (code, jt, jf, k): refuse a foreign ABI and ``numbers``, allow the rest."""
    checks = ([(_JGE, foreign_from)] if foreign_from is not None else []) + [
        (_JEQ, n) for n in numbers]
    program = [(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
               (_JEQ, 1, 0, arch),  # native: skip the refusal below
               (_RET, 0, 0, _RET_EPERM),
               (_LD_W_ABS, 0, 0, _NR_OFFSET)]
    for i, (code, k) in enumerate(checks):
        program.append((code, len(checks) - i, 0, k))  # true: jump to the final refusal
    return program + [(_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, _RET_EPERM)]


@functools.cache
def _program() -> _Program | None:
    """The filter for this machine, built before forking; None where its numbers are unknown."""
    known = _ARCHES.get(platform.machine())
    if known is None:
        return None
    arch, foreign_from, calls = known
    instructions = _instructions(arch, foreign_from, [calls[name] for name in REFUSED_CALLS])
    array = (_Instruction * len(instructions))(*(_Instruction(*i) for i in instructions))
    program = _Program(len(instructions), array)
    program._array = array  # kept alive with the program
    return program


def prepare() -> None:
    """Build the filter (in the parent: the child between fork and exec only installs it)."""
    _program()


def install(libc: ctypes.CDLL) -> bool:
    """In the child: refuse ``REFUSED_CALLS`` from now on. False where this machine's numbers
    are unknown or the kernel has no seccomp filters (nothing is refused then)."""
    program = _program()
    if program is None:
        return False

    def prctl(*args: int) -> bool:  # every argument an unsigned long, as the kernel reads them
        return libc.prctl(*(ctypes.c_ulong(a) for a in args)) == 0

    return (prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            and prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0))
