"""Files a run writes and trusts on later runs: written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal_jax.config import ConfigError


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


def read_json(path: str | Path) -> Any:
    """The JSON in ``path``; a file that does not parse raises ``ConfigError`` naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); it was written by an earlier run "
                          "of this run_dir: delete it to measure or record it again") from e
