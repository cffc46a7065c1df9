"""Read the rows of a local JSONL or Parquet file, each with a location for error messages."""

from __future__ import annotations

import json
from pathlib import Path


class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and field."""


def read_rows(path: str | Path, fmt: str, setting: str = "dataset.path"
              ) -> list[tuple[str, dict]]:
    """(location, row) pairs; location is "line N" (JSONL, from 1) or "row N" (Parquet, from 0).
    A missing file names ``setting`` and, for a relative path, the directory it was read in."""
    path = Path(path)
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()}, where the command runs)"
        raise DatasetError(f"{setting}: dataset file {path} does not exist{where}")
    if fmt == "jsonl":
        rows = _read_jsonl(path)
    elif fmt == "parquet":
        rows = _read_parquet(path)
    else:
        raise DatasetError(f"dataset format {fmt!r} is not one of jsonl, parquet")
    if not rows:
        raise DatasetError(f"dataset file {path} has no rows")
    return rows


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path} line {number}: not valid UTF-8 ({e.reason} at byte "
                                   f"{e.start})") from None
            if not line.strip():
                continue
            array = number == 1 and line.lstrip().startswith("[")
            hint = ": a JSON array is not read; write one JSON object per line (JSONL)"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {number}: invalid JSON ({e.msg})"
                                   f"{hint if array else ''}") from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise DatasetError(f"{path} line {number}: {e}") from None
            except RecursionError:
                raise DatasetError(f"{path} line {number}: JSON nested too deeply") from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path} line {number}: expected a JSON object, got {type(row).__name__}"
                    f"{hint if array else ''}")
            rows.append((f"line {number}", row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from e
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]
