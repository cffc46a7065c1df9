"""One process at a time in a run directory: the one that trains it (``train``, ``sft``).

Two processes training the same run (a job requeued while its first attempt still runs, a
command started twice) would each resume from the other's checkpoints, prune the other's
exports and force their own weights on the shared rollout servers (which take both for the
same run). The process that trains a run directory holds an exclusive ``flock`` on its
``.lock`` file for as long as it runs; another is refused at once, told which process holds it.
The kernel drops the lock when the holder exits, however it exits (a killed trainer leaves no
stale lock). On a network filesystem the lock is as good as its ``flock`` (NFSv4 supports it);
where ``flock`` fails (Lustre mounted without it, NFSv3 without lockd) a warning says the run
is unguarded, and it goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from areal_jax.config import ConfigError

LOCK_FILE = ".lock"

log = logging.getLogger(__name__)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, command: str) -> Iterator[None]:
    """Hold ``run_dir`` for this process meanwhile (``command`` names what holds it); a
    ``ConfigError`` naming the holder when another process holds it. Where the filesystem
    cannot lock, a warning says so and the run goes on unguarded."""
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            raise _in_use(run_dir, holder) from None
        except OSError as e:  # a filesystem without flock (Lustre without it, NFSv3 without
            # lockd): the run goes on unguarded rather than not at all
            log.warning("could not lock %s (%s): nothing stops a second process from training "
                        "this run at the same time; make sure only one does", path, e)
            yield
            return
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"`areal-jax {command}` (pid {os.getpid()} on {socket.gethostname()}, "
                      f"since {started})\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _in_use(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"run_dir {run_dir} is in use by {holder}: two processes training one run would "
        "overwrite each other's checkpoints and exports and the weights their rollout servers "
        "serve. Wait for it to end or stop it (the same command then resumes), or use another "
        "run_dir")
