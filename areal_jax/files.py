"""Files a run writes and trusts on later runs: written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_jax.config import ConfigError
from areal_jax.processes import process_running


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary sibling renamed into place, so a
    crash or a full disk leaves the old file or none, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_unfinished_writes(directory: str | Path) -> list[Path]:
    """Delete the temporary files ``write_atomic`` left in ``directory`` when its writer was
    killed (``.NAME.tmp-PID`` of a process no longer running); returns what it deleted."""
    removed = []
    for path in Path(directory).glob(".*.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and path.is_file() and not process_running(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def write_jsonl(path: str | Path, records) -> None:
    """Write ``records`` (JSON objects) one per line, whole or not at all (``write_atomic``)."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def read_json(path: str | Path, numbers: tuple[str, ...] = ()) -> dict:
    """The JSON object in ``path``, which must hold a number under each key in ``numbers``; a
    file that does not parse, or is not such an object, raises ``ConfigError`` naming it."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # UTF-8 errors are ValueErrors
        problem = f"is not valid JSON ({e!s:.200})"
    else:
        if not isinstance(value, dict):
            problem = f"holds a JSON {type(value).__name__}, not an object"
        else:
            wrong = [k for k in numbers if isinstance(value.get(k), bool)
                     or not isinstance(value.get(k), (int, float))]
            if not wrong:
                return value
            problem = f"has no number under {', '.join(map(repr, wrong))}"
    raise ConfigError(f"{path} {problem}; it was written by an earlier run of this run_dir: "
                      "delete it to measure or record it again")
