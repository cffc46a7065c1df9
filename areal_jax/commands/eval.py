"""``areal-jax eval --config CONFIG --model DIR``: held-out accuracy of an HF checkpoint."""

from __future__ import annotations

import argparse

NAME = "eval"
HELP = "Accuracy of a Hugging Face checkpoint on the config's eval dataset, through rollout servers."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment YAML (its eval and rollout sections)")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from pathlib import Path

    from areal_jax.commands._preflight import preflight
    from areal_jax.config import load_config
    from areal_jax.controller.evaluation import evaluate_checkpoint
    from areal_jax.experiment import ExperimentConfig

    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    preflight(cfg)
    result = asyncio.run(evaluate_checkpoint(cfg, Path(args.model)))
    print(json.dumps(result, indent=2))
    return 0
