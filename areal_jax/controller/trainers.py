"""Building trainers from the experiment config (the RL trainer and the SFT warm start's)."""

from __future__ import annotations

from pathlib import Path

from areal_jax.config import from_dict
from areal_jax.experiment import ExperimentConfig


def make_trainer(cfg: ExperimentConfig, model_path: Path, sft: bool = False,
                 run_dir: Path | None = None):
    """A Trainer for ``model_path`` with the experiment's trainer config (``sft``: the SFT warm
    start's, ``sft.trainer`` on top)."""
    from areal_jax.trainer import Trainer
    from areal_jax.trainer.config import TrainerConfig

    data = cfg.trainer_fields(sft)
    data["model_path"] = str(model_path)
    data["run_dir"] = str(run_dir or cfg.run_dir)
    return Trainer(from_dict(TrainerConfig, data))
