"""Learning curves from ``RUN_DIR/metrics.jsonl`` to a PNG grid.

Panels and the metric keys they read (a panel appears when any of its keys is present):

- Reward: ``reward/mean``
- Eval accuracy: ``eval/accuracy``, and the accuracy of kept exports measured after the run
  (``RUN_DIR/eval_curve.jsonl`` from ``areal-jax eval --curve``) when that file exists
- Response length (tokens): ``response_length/mean``, ``response_length/max``
- Staleness (versions): ``staleness/mean``, ``staleness/max``
- Throughput (tokens/s): ``throughput/tokens_per_s``
- Loss: ``loss``
- Grad norm: ``grad_norm``
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from areal_jax.metrics import EVAL_CURVE_FILE, METRICS_FILE, read_records

logger = logging.getLogger(__name__)

CURVE_KEY = "eval/accuracy (exports, after the run)"
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("Reward", ("reward/mean",)),
    ("Eval accuracy", ("eval/accuracy", CURVE_KEY)),
    ("Response length (tokens)", ("response_length/mean", "response_length/max")),
    ("Staleness (versions)", ("staleness/mean", "staleness/max")),
    ("Throughput (tokens/s)", ("throughput/tokens_per_s",)),
    ("Loss", ("loss",)),
    ("Grad norm", ("grad_norm",)),
]
PANEL_SIZE_IN = (5.0, 3.5)
DPI = 100
MAX_COLUMNS = 3


class PlotError(ValueError):
    """The metrics file is missing, unreadable or has nothing to plot."""


def read_series(path: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) for every numeric metric in a metrics JSONL; nulls are skipped,
    and so are lines that are not records (a run that crashed mid-write), with a warning."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"metrics file {path} does not exist")
    series: dict[str, tuple[list[int], list[float]]] = {}
    skipped = []
    for number, _, record in read_records(path):
        if record is None:
            skipped.append(number)
            continue
        for key, value in record.items():
            if key in ("step", "wall_time") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                steps, values = series.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    if skipped:
        logger.warning("%s: skipped %d lines that are not metrics records (line %s%s)", path,
                       len(skipped), skipped[0], ", ..." if len(skipped) > 1 else "")
    return series


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the learning-curve grid of ``run_dir`` to ``out`` (default ``RUN_DIR/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.backend_bases import FigureCanvasBase

    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "curves.png"
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if out.suffix.lower().lstrip(".") not in formats or out.is_dir():
        raise PlotError(f"--out {out}: not an image file name (ending in .{', .'.join(formats)})")
    series = read_series(run_dir / METRICS_FILE)
    if (run_dir / EVAL_CURVE_FILE).is_file():
        curve = read_series(run_dir / EVAL_CURVE_FILE).get("eval/accuracy")
        if curve:
            series[CURVE_KEY] = curve
    panels = [(title, [k for k in keys if k in series]) for title, keys in PANELS]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        known = ", ".join(k for _, keys in PANELS for k in keys)
        raise PlotError(f"{run_dir / METRICS_FILE} has none of the plotted metrics ({known})")
    ncols = min(MAX_COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(PANEL_SIZE_IN[0] * ncols, PANEL_SIZE_IN[1] * nrows),
        dpi=DPI,
        squeeze=False,
    )
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, label=key, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(run_dir.resolve().name)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI)
    except OSError as e:
        raise PlotError(f"--out {out}: cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
