"""``areal-jax export --config CONFIG --out DIR [--version N]``: Orbax checkpoint -> HF directory."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "export"
HELP = "Export a training checkpoint (latest, or --version) as a Hugging Face model directory."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the experiment YAML the run used")
    parser.add_argument("--out", required=True, help="output directory: new, empty, or an earlier export (replaced atomically)")
    parser.add_argument("--version", type=int, default=None, help="checkpoint version (default: the newest)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def run(args: argparse.Namespace) -> int:
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.prepare import base_model_path, check_checkpoints_model
    from areal_jax.controller.prepare import starting_model
    from areal_jax.controller.trainers import make_trainer
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.models import export_hf
    from areal_jax.models.hf_export import check_export_target

    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    check_checkpoints_model(cfg)
    out = Path(args.out).resolve()
    start = starting_model(cfg)
    for what, path in (("the run directory", cfg.run_dir),
                       ("the run's base model", base_model_path(cfg)),
                       ("the run's starting model", start)):
        path = Path(path).resolve()
        if out == path or out in path.parents:
            raise ConfigError(f"--out {args.out}: is {what} ({path}) or holds it; an export "
                              "replaces its output directory: choose a new one")
    check_export_target(out)
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    if not checkpoints.is_dir():
        raise ConfigError(f"no checkpoint under {checkpoints}")
    trainer = make_trainer(cfg, start)
    versions = trainer.checkpoint_versions()
    if not versions:
        raise ConfigError(f"no checkpoint under {checkpoints}")
    version = versions[-1] if args.version is None else args.version
    if version not in versions:
        raise ConfigError(f"--version {version}: no such checkpoint under {checkpoints}; "
                          f"there are {', '.join(map(str, versions))}")
    trainer.restore(version)  # read only: a damaged checkpoint is an error, not skipped
    out = export_hf(trainer.model, out, dtype=args.dtype, tokenizer_dir=start, source_dir=start)
    print(f"exported version {trainer.version} to {out}")
    return 0
