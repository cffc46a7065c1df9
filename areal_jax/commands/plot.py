"""``areal-jax plot RUN_DIR [--out PNG]``: learning curves of a run as a PNG grid."""

from __future__ import annotations

import argparse
import sys

NAME = "plot"
HELP = "Plot learning curves from RUN_DIR/metrics.jsonl to a PNG."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/curves.png)")


def run(args: argparse.Namespace) -> int:
    from areal_jax.plotting import PlotError, plot_run

    try:
        out = plot_run(args.run_dir, args.out)
    except PlotError as e:
        print(f"areal-jax plot: error: {e}", file=sys.stderr)
        return 2  # a user error, as every command's
    print(out)
    return 0
