"""``areal-jax export --config CONFIG --out DIR [--version N]``: Orbax checkpoint -> HF directory."""

from __future__ import annotations

import argparse

NAME = "export"
HELP = "Export a training checkpoint (latest, or --version) as a Hugging Face model directory."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the experiment YAML the run used")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--version", type=int, default=None, help="checkpoint version (default: latest)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def run(args: argparse.Namespace) -> int:
    from areal_jax.config import load_config
    from areal_jax.controller.prepare import starting_model
    from areal_jax.controller.trainers import make_trainer
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.models import export_hf

    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    start = starting_model(cfg)
    trainer = make_trainer(cfg, start)
    if trainer.restore(args.version) is None:
        print(f"no checkpoint under {cfg.run_dir}/checkpoints", flush=True)
        return 1
    out = export_hf(trainer.model, args.out, dtype=args.dtype, tokenizer_dir=start)
    print(f"exported version {trainer.version} to {out}")
    return 0
