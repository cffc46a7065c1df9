"""A filesystem jail for the sandbox: an empty tmpfs root holding only the system directories.

Built in the forked child (as root, inside its own mount namespace) before it drops to the
sandbox uid: a tmpfs becomes the new root, the system directories and the interpreter's
``bin``/``lib`` are bind-mounted into it read-only, the work directory at ``/sandbox``; ``/dev``
has only ``null``, ``zero``, ``random`` and ``urandom``, and ``/tmp`` lives in the tmpfs.
Everything else (home directories, the caller's working and run directories, datasets,
``/proc``) is absent.
"""

from __future__ import annotations

import ctypes
import functools
import os

from areal_jax.processes import libc

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PREFIX_ENTRIES = ("bin", "lib", "lib64", "pyvenv.cfg")  # what Python needs of its prefix
DEVICES = ("null", "zero", "random", "urandom")
WORK = "/sandbox"  # the cwd; named so that no interpreter prefix lies below it

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def enc(s):
        return s.encode() if s else None

    if libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


@functools.cache
def read_only_paths(python: str) -> tuple[str, ...]:
    """Paths to show inside the jail: the system directories and ``python``'s installation.

    Of the prefix of the path as given (a virtual environment) and of the resolved binary, only
    ``PREFIX_ENTRIES`` are shown, so a prefix such as a home directory is not exposed whole.
    Computed in the parent, before forking.
    """
    found = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
    for exe in (os.path.abspath(python), os.path.realpath(python)):
        prefix = os.path.dirname(os.path.dirname(exe))
        for entry in PREFIX_ENTRIES:
            path = os.path.join(prefix, entry)
            if os.path.lexists(path) and not any(_inside(path, d) for d in found):
                found.append(path)
    return tuple(found)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def enter(jail: str, workdir: str, read_only: tuple[str, ...], size_bytes: int) -> None:
    """Make ``jail`` the root (a fresh tmpfs) and ``WORK`` (bound to ``workdir``) the cwd."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the caller
    _mount("tmpfs", jail, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_bytes},mode=755")
    for src in read_only:
        dst = jail + src
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):  # e.g. /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        _mount(src, dst, None, _MS_BIND | _MS_REC)
        _mount(None, dst, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID)
    os.makedirs(jail + "/dev", exist_ok=True)  # may hold an interpreter path already
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(jail + "/dev/" + name, "w").close()
            _mount("/dev/" + name, jail + "/dev/" + name, None, _MS_BIND)
    os.makedirs(jail + "/tmp", exist_ok=True)
    os.chmod(jail + "/tmp", 0o1777)
    os.mkdir(jail + WORK)
    _mount(workdir, jail + WORK, None, _MS_BIND)
    os.chroot(jail)
    os.chdir(WORK)
