"""Terminal progress for long phases (SFT, RL): step, reward, tokens/s, staleness, ETA."""

from __future__ import annotations

import math
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.progress import TimeElapsedColumn, TimeRemainingColumn

_SHOWN = (("loss", "loss {:.4g}"), ("reward/mean", "reward {:.3f}"),
          ("throughput/tokens_per_s", "{:.0f} tok/s"), ("staleness/mean", "stale {:.2f}"),
          ("staleness/max", "max {:.0f}"), ("rollout/busy_fraction", "busy {:.2f}"))


def summary(metrics: dict) -> str:
    """A one-line digest of the metrics users watch."""
    parts = []
    for key, fmt in _SHOWN:
        value = metrics.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(fmt.format(value))
    return "  ".join(parts)


class TrainingProgress:
    """A rich progress display; when stdout is not a terminal it prints a line per step, at
    most ``lines`` of them per phase (``start_phase``). ``enabled=False`` (trainer processes
    other than the leader) shows nothing."""

    def __init__(self, enabled: bool = True):
        self._console = Console(file=sys.stdout)
        self._live = self._console.is_terminal and enabled
        self._quiet = not enabled
        self._progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=self._console, disable=not self._live)

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._progress.__exit__(*exc)

    def start_phase(self, name: str, total: int | None, completed: int = 0, lines: int = 100):
        if not self._live and not self._quiet:
            print(f"== {name}", flush=True)
        every = max(1, math.ceil((total or 0) / lines))
        return self._progress.add_task(name, total=total, completed=completed, info="",
                                       every=every)

    def advance(self, task, metrics: dict | None = None) -> None:
        """One more step of ``task``; nothing once the phase has ended (an answer arriving
        after its evaluation was given up)."""
        ids = [x.id for x in self._progress.tasks]
        if task not in ids:
            return
        info = summary(metrics or {})
        self._progress.update(task, advance=1, info=info)
        if not self._live and not self._quiet:
            t = self._progress.tasks[ids.index(task)]
            done, total = int(t.completed), int(t.total or 0)
            if done % t.fields["every"] == 0 or done == total:
                print(f"  {t.description} {done}/{total}  {info}".rstrip(), flush=True)

    def end_phase(self, task) -> None:
        self._progress.remove_task(task)
