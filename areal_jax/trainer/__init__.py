"""The trainer: jitted, sharded PPO/SFT steps, Orbax checkpoints and versioned HF exports."""

from areal_jax.trainer.checkpoint import (
    CheckpointCorruptError, CheckpointMismatchError, Checkpointer,
)  # fmt: skip
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.optimizer import lr_schedule, make_optimizer
from areal_jax.trainer.publish import export_path, list_exports, prune_exports, publish_version
from areal_jax.trainer.step import TrainState
from areal_jax.trainer.trainer import PublishSnapshot, Trainer

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "Checkpointer",
    "PublishSnapshot",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "export_path",
    "list_exports",
    "lr_schedule",
    "make_optimizer",
    "prune_exports",
    "publish_version",
]
