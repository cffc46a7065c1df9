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
    """Live (non-zombie) processes whose command line holds ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(name))
    return found
