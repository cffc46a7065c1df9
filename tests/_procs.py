"""Process checks shared by the tests that kill processes and look for what is left."""

from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (one waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
