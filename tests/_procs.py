"""Process checks shared by the tests that kill processes and look for what is left."""

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (one waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def marked(mark: str) -> list[int]:
    """Processes with a live (non-zombie) thread whose command line holds ``mark`` (a process
    whose main thread exited shows as a zombie with an empty command line while its other
    threads run on: each thread is read)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            threads = os.listdir(f"/proc/{name}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{name}/task/{tid}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{name}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if mark.encode() in cmdline and state not in ("Z", "X"):
                found.append(int(name))
                break
    return found
