"""``TrainerConfig``: every option of the trainer in one typed, validated dataclass."""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.config import ConfigError
from areal_jax.parallel import MeshConfig
from areal_jax.protocol import GREEDY_TEMPERATURE
from areal_jax.rl import AdvantageConfig, LossConfig, MicroBatchConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Model, optimiser, PPO, checkpoint and export options (YAML section ``trainer``).

    Step counts of the learning-rate schedule (``warmup_steps``, ``total_steps``) count
    optimiser updates; one ``train_on_batch`` makes ``ppo_n_minibatches`` of them.
    ``run_dir`` holds ``checkpoints/`` and ``exports/v{version:06d}/``.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None  # copied into exports; defaults to model_path
    ref_model_path: str | None = None  # KL reference; defaults to the initial policy
    run_dir: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay fp32
    remat: Literal["none", "full", "dots"] = "none"
    scan_layers: bool = True  # False unrolls the layer loop: faster steps, longer compiles
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    seed: int = 0

    lr: float = 2e-5
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 0  # cosine horizon, in optimiser updates; 0: the experiment's whole phase
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.01  # on weight matrices, not on norms and biases
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clip; null = off

    ppo_n_minibatches: int = 4
    micro_batch: MicroBatchConfig = dataclasses.field(default_factory=MicroBatchConfig)
    # sampling temperature, log-probs are recomputed at it; null: the experiment's sampling
    # temperature (1.0 for a trainer built alone)
    temperature: float | None = None
    max_new_tokens: int | None = None  # generation budget, needed by the overlong penalty
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    logprob_chunk_size: int = 256
    compile_ahead: bool = True  # compile the programs of likely next shapes in the background
    # where: "process" (a helper process at the lowest priority), "thread", or "auto": the
    # process on a single-process CPU trainer with the compilation cache on, else the thread
    compile_ahead_in: Literal["auto", "process", "thread"] = "auto"
    # on an accelerator, jobs compiled ahead at once, each on a thread (not in the helper)
    compile_ahead_threads: int = 1
    # XLA's backend (LLVM) optimisation level of the train programs on a CPU backend, 0-3;
    # null: XLA's own default (2). 1 compiles about a fifth faster at the same step time.
    cpu_opt_level: int | None = 1

    checkpoint_keep: int = 3
    checkpoint_async: bool = True
    export_keep: int = 2
    export_keep_every: int = 0  # also keep versions that are multiples of it (0: none)
    export_dtype: Literal["source", "float32", "bfloat16"] = "source"

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are recomputed at: ``temperature``, 1.0 where unset."""
        return 1.0 if self.temperature is None else self.temperature

    def check_cosine_horizon(self) -> None:
        """The cosine schedule needs ``total_steps`` past ``warmup_steps``."""
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}) for the cosine schedule: its horizon, in optimiser "
                f"updates (ppo_n_minibatches per RL version, one per SFT step)")

    def __post_init__(self):
        for name in ("model_path", "tokenizer_path", "ref_model_path", "run_dir"):
            if getattr(self, name) == "":
                raise ConfigError(f"{name} must be a path or null, got an empty string")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed: must be in [0, 2**32), got {self.seed}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"remat must be none, full or dots, got {self.remat!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.compile_ahead_in not in ("auto", "process", "thread"):
            raise ConfigError("compile_ahead_in must be auto, process or thread, got "
                              f"{self.compile_ahead_in!r}")
        if self.cpu_opt_level is not None and self.cpu_opt_level not in (0, 1, 2, 3):
            raise ConfigError(f"cpu_opt_level must be 0, 1, 2, 3 or null, got "
                              f"{self.cpu_opt_level!r}")
        if self.export_dtype not in ("source", "float32", "bfloat16"):
            raise ConfigError(
                f"export_dtype must be source, float32 or bfloat16, got {self.export_dtype!r}"
            )
        _positive(self, "lr", "adam_eps")
        if self.temperature is not None and not self.temperature >= GREEDY_TEMPERATURE:
            raise ConfigError(
                f"temperature: {self.temperature:g} is below {GREEDY_TEMPERATURE:g}, which "
                "samples greedily and reports log-probs at temperature 1: set 1.0")
        _at_least(self, 0, "warmup_steps", "total_steps", "weight_decay", "export_keep_every")
        _at_least(self, 1, "ppo_n_minibatches", "logprob_chunk_size", "checkpoint_keep",
                  "compile_ahead_threads")
        if self.export_keep < 2:  # with one, writing the next export removed the one served
            raise ConfigError(f"export_keep must be >= 2, got {self.export_keep}: with 1, "
                              "writing the next export removes the one the servers serve (a "
                              "server rejoining meanwhile loads it)")
        if self.total_steps:  # 0: left to an experiment to set (``check_cosine_horizon``)
            self.check_cosine_horizon()
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("adam_b1", "adam_b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"grad_clip must be > 0 or null, got {self.grad_clip}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
        if self.advantage.overlong_window > 0 and self.max_new_tokens is None:
            raise ConfigError("advantage.overlong_window > 0 needs max_new_tokens")

    @property
    def uses_reference(self) -> bool:
        """Whether a frozen reference model is needed (KL penalty on)."""
        return self.advantage.kl_beta > 0


def _positive(cfg: TrainerConfig, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(cfg, name)}")


def _at_least(cfg: TrainerConfig, low: int, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < low:
            raise ConfigError(f"{name} must be >= {low}, got {getattr(cfg, name)}")
