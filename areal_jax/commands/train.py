"""``areal-jax train --config CONFIG [key=value ...]``: asynchronous RL (resumes if possible)."""

from __future__ import annotations

import argparse

NAME = "train"
HELP = "Train with asynchronous decoupled PPO through rollout servers (resumes a stopped run)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. schedule.total_steps=50")


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from areal_jax.commands._preflight import preflight
    from areal_jax.config import load_config
    from areal_jax.controller.run import train
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.stopping import stop_on_sigterm

    console = "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.WARNING, format=console)
    for handler in logging.getLogger().handlers:  # importing Orbax may have given the root
        handler.setFormatter(logging.Formatter(console))  # absl's default handler already
    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    preflight(cfg)
    # SIGTERM (kill, scancel, docker stop) stops the run as Ctrl-C does: servers stopped,
    # checkpoint writes finished, and a line saying how to go on.
    stop_on_sigterm()
    try:
        results = train(cfg)
    except KeyboardInterrupt:
        print(f"areal-jax train: stopped; {_how_it_goes_on(cfg)}", file=sys.stderr, flush=True)
        return 130
    before, after = results.get("before"), results.get("after")
    if before and after:
        print(f"RL changed held-out accuracy {before['eval/accuracy']:.3f} -> "
              f"{after['eval/accuracy']:.3f} in {results['wall_s']:.0f} s; "
              f"curves: areal-jax plot {cfg.run_dir}")
    return 0


def _how_it_goes_on(cfg) -> str:
    """What re-running the command does after a stop: resume from a checkpoint, or start RL
    (or the whole run: SFT keeps no checkpoint) again."""
    from pathlib import Path

    from areal_jax.controller.sft_phase import sft_model_kept

    checkpoints = Path(cfg.run_dir) / "checkpoints"
    newest = max((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()),
                 default=None) if checkpoints.is_dir() else None
    if newest is not None:
        return (f"the same command resumes from the newest intact checkpoint in {checkpoints} "
                f"(the newest: version {newest})")
    if cfg.sft.steps and sft_model_kept(cfg):
        return "no checkpoint of RL yet: the same command starts RL again from the SFT model"
    if cfg.sft.steps:
        return "stopped before SFT ended (it keeps no checkpoint): the same command starts over"
    return "no checkpoint yet: the same command starts over"
