"""Training metrics to ``RUN_DIR/metrics.jsonl`` and TensorBoard events in ``RUN_DIR/tensorboard``.

Each ``log(step, metrics)`` appends one JSON object ``{"step", "wall_time", <metrics>...}``;
non-finite values are written as ``null`` (TensorBoard gets them as they are). Steps must not
decrease, except in a ``late`` row (an evaluation of a version that ran beside later steps).
Resuming with ``resume_from_step=s`` first drops every line with ``step >= s`` (and a torn
last line) from the JSONL, and tells TensorBoard to purge events from ``s`` on.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from collections.abc import Iterator
from pathlib import Path

from areal_jax.files import write_atomic

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Held-out accuracy of a finished run's kept exports, written by `areal-jax eval --curve`.
EVAL_CURVE_FILE = "eval_curve.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "wall_time")


class MetricsLogger:
    """Append-only metrics log; use as a context manager or call ``close()``."""

    def __init__(self, run_dir: str | Path, resume_from_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.last_step = _truncate(self.path, resume_from_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._writer = SummaryWriter(
            str(self.run_dir / TENSORBOARD_DIR),
            purge_step=resume_from_step,
            flush_secs=30,
            filename_suffix=f".{os.getpid()}.{time.time_ns()}",  # a reopened run gets its own file
        )

    def log(self, step: int, metrics: dict, late: bool = False) -> None:
        """Record ``metrics`` (name -> number) at ``step`` (``late``: may be below the last
        logged step)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"metrics step must be a non-negative integer, got {step!r}")
        step = int(step)
        if self.last_step is not None and step < self.last_step and not late:
            raise ValueError(
                f"metrics step {step} is before the last logged step {self.last_step} "
                f"in {self.path}; "
                "pass resume_from_step to rewrite from an earlier step"
            )
        values = {name: _to_float(name, value) for name, value in metrics.items()}
        wall_time = time.time()
        record = {"step": step, "wall_time": wall_time}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)
        self._writer.flush()
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            self._writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_float(name, value) -> float:
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric names must be non-empty strings, got {name!r}")
    if name in _RESERVED:
        raise ValueError(f"metric name {name!r} is reserved")
    try:
        return float(value)  # ints, floats, bools, numpy and 0-d JAX arrays
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} is not a number: {value!r:.80}") from None


def read_records(path: Path) -> Iterator[tuple[int, str, dict | None]]:
    """(line number, line, record) of every non-blank line of a metrics JSONL; the record is
    None where the line is not a JSON object with an integer ``step`` (torn by a crash, or
    damaged: undecodable bytes are read as U+FFFD and fail here, not in the caller)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record["step"] = int(record["step"])
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                record = None
            yield number, line, record


def _truncate(path: Path, resume_from_step: int | None) -> int | None:
    """Keep the lines with step < resume_from_step (all when None); return the last kept step.
    The file is rewritten when a line is dropped or the last one lacks its newline (the next
    record would be appended to it)."""
    if not path.exists():
        return None
    kept, last_step, dropped, unterminated = [], None, 0, False
    for _, line, record in read_records(path):
        if record is None:
            dropped += 1  # a line torn by a crash
            continue
        step = record["step"]
        if resume_from_step is not None and step >= resume_from_step:
            dropped += 1
            continue
        if not line.endswith("\n"):
            unterminated, line = True, line + "\n"
        kept.append(line)
        last_step = step if last_step is None else max(last_step, step)
    if dropped or unterminated:
        logger.info("%s: dropped %d lines on resume from step %s", path, dropped, resume_from_step)
        write_atomic(path, "".join(kept))
    return last_step
