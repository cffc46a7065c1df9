"""The experiment config behind ``areal-jax train`` / ``sft`` / ``eval``: one YAML file.

``model_path: tiny`` builds the tiny model kit into the run directory; ``synthetic:`` writes the
built-in arithmetic task's train/test files there, and dataset paths may use ``{run_dir}``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Literal

from areal_jax.config import ConfigError, from_dict, to_dict
from areal_jax.protocol.addresses import check_address
from areal_jax.controller.local_servers import (JAX_DEFAULT_MEMORY_FRACTION,
                                               MEMORY_FRACTION_VARIABLE)
from areal_jax.data.config import DatasetConfig
from areal_jax.data.synthetic import SyntheticConfig
from areal_jax.models.tiny import TinyModelSpec
from areal_jax.protocol import GREEDY_TEMPERATURE
from areal_jax.rl.advantages import GROUP_RELATIVE_ESTIMATORS
from areal_jax.trainer.config import TrainerConfig

FLOAT32_MAX = 3.4028234663852886e38  # sampling settings travel as float32
MAX_SEED = 2**32  # a request's seed, seed * 1_000_003 + n, must fit the protocol's uint64


@dataclasses.dataclass
class SamplingConfig:
    """How rollout servers sample during training."""

    group_size: int = 4
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self):
        if self.group_size < 1:
            raise ConfigError(f"sampling.group_size: must be >= 1, got {self.group_size}")
        _check_generation("sampling", self.max_new_tokens, self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"sampling.top_k: must be -1 (all) or >= 1, got {self.top_k}")


def _check_generation(section: str, max_new_tokens: int, temperature: float) -> None:
    """What the rollout servers would refuse in every request, refused before the run starts."""
    if max_new_tokens < 1:
        raise ConfigError(f"{section}.max_new_tokens: must be >= 1, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):  # also rejects NaN
        raise ConfigError(f"{section}.temperature: must be finite and >= 0, got {temperature}")
    if temperature > FLOAT32_MAX:  # sent as a float32: it would arrive as inf
        raise ConfigError(f"{section}.temperature: must be at most {FLOAT32_MAX:.3g} (a "
                          f"float32), got {temperature:g}")


@dataclasses.dataclass
class ScheduleConfig:
    """Batching and the staleness gate. ``mode: sync`` pauses generation during training and
    forces ``max_staleness: 0`` (the synchronous baseline).

    The gate bounds staleness when a group is submitted; a slow group can still reach the
    trainer later than ``max_staleness`` versions. ``overstale`` says what happens to it when
    batches are formed: ``train`` (default, as AReaL: the decoupled objective corrects for it,
    and ``staleness/*`` metrics report how much of it was trained on) or ``drop`` (discard it
    and generate its prompt again, so no token older than the bound is ever trained on).
    """

    mode: Literal["async", "sync"] = "async"
    batch_size: int = 16  # prompt groups per trainer step
    max_staleness: int = 4  # η
    max_in_flight: int = 64  # groups being generated at once
    total_steps: int = 100
    overstale: Literal["train", "drop"] = "train"

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"schedule.batch_size: must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"schedule.max_staleness: must be >= 0, got {self.max_staleness}")
        if self.max_in_flight < 1:
            raise ConfigError(f"schedule.max_in_flight: must be >= 1, got {self.max_in_flight}")
        if self.total_steps < 0:
            raise ConfigError(f"schedule.total_steps: must be >= 0, got {self.total_steps}")
        if self.mode == "sync":
            self.max_staleness = 0


@dataclasses.dataclass
class RolloutConfig:
    """Where generation happens: local servers launched by the trainer, or given addresses."""

    addresses: list[str] = dataclasses.field(default_factory=list)  # empty: launch locally
    # a file listing more addresses, one per line, followed as it changes: servers join and
    # leave the running pool as lines are added and removed
    addresses_file: str | None = None
    num_local_servers: int = 1
    cpu_sets: list[list[int]] | None = None  # one CPU list per local server
    server: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra server config keys
    weights_transport: Literal["path", "push"] = "path"
    auth_token_env: str | None = None  # environment variable holding the shared token
    tls_root_cert: str | None = None  # PEM file of the servers' CA, turns on TLS
    rpc_timeout_s: float = 60.0  # deadline of status / pause / resume calls
    update_timeout_s: float = 600.0  # deadline of a weight update (transfer and load)
    rpc_retries: int = 3  # retries of a control call that found a server unavailable
    rejoin_interval_s: float = 5.0  # how often a failed server is tried again
    no_server_timeout_s: float = 300.0  # stop when no server has been reachable this long
    start_timeout_s: float = 300.0  # at the start, how long the first server has to answer
    max_request_attempts: int = 8  # sends of one group failing on servers before the run stops
    keepalive_s: float = 20.0  # a server not answering transport pings this long leaves the pool
    # a server holding groups that sends none back and generates no token for this long (up to
    # twice this) leaves the pool, its groups sent elsewhere
    stall_timeout_s: float = 300.0
    max_consecutive_rejections: int = 32  # invalid groups in a row before the run stops
    # Accelerators of local servers: one list of device ids per server (CUDA_VISIBLE_DEVICES /
    # TPU_VISIBLE_CHIPS), and the fraction of each device's memory a server's JAX may take.
    server_devices: list[list[int]] | None = None
    server_memory_fraction: float | None = None

    def __post_init__(self):
        for name in ("rpc_timeout_s", "update_timeout_s", "rejoin_interval_s",
                     "no_server_timeout_s", "keepalive_s", "start_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"rollout.{name}: must be > 0, got {getattr(self, name)}")
        if self.rpc_retries < 0:
            raise ConfigError(f"rollout.rpc_retries: must be >= 0, got {self.rpc_retries}")
        for name in ("max_request_attempts", "max_consecutive_rejections", "num_local_servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name}: must be >= 1, got {getattr(self, name)}")
        for i, address in enumerate(self.addresses):
            try:
                check_address(address, f"rollout.addresses[{i}]")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        fraction = self.server_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"rollout.server_memory_fraction: must be in (0, 1], got {fraction}")
        for key in ("cpu_sets", "server_devices"):
            sets = getattr(self, key)
            if sets is not None and not self.remote and len(sets) != self.num_local_servers:
                raise ConfigError(f"rollout.{key}: {len(sets)} entries for "
                                  f"{self.num_local_servers} local servers (one each)")

    @property
    def remote(self) -> bool:
        """Whether the servers are given (``addresses`` or ``addresses_file``), not launched."""
        return bool(self.addresses or self.addresses_file)


# Default shares of a device's memory where JAX processes share it and no fraction is set: the
# trainer's, the local servers' together beside a trainer, and theirs together without one.
SHARED_TRAINER_FRACTION = 0.55
SHARED_SERVERS_FRACTION = 0.35
SERVERS_ALONE_FRACTION = 0.9


def _environment_memory_fraction() -> float:
    """The share of each device a JAX process started from this environment takes."""
    try:
        return float(os.environ.get(MEMORY_FRACTION_VARIABLE, JAX_DEFAULT_MEMORY_FRACTION))
    except ValueError:
        return JAX_DEFAULT_MEMORY_FRACTION


@dataclasses.dataclass
class SFTConfig:
    """Supervised warm start before RL, on ``response_key`` of the training prompts' metadata."""

    steps: int = 0
    batch_size: int = 64  # examples per step
    response_key: str = "solution"
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)  # overrides of `trainer`

    def __post_init__(self):
        if self.steps < 0:
            raise ConfigError(f"sft.steps: must be >= 0 (0: no SFT), got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"sft.batch_size: must be >= 1, got {self.batch_size}")
        if not self.response_key:
            raise ConfigError("sft.response_key: must not be empty")


@dataclasses.dataclass
class EvalConfig:
    """Held-out accuracy through the rollout servers (greedy by default)."""

    dataset: DatasetConfig | None = None
    max_prompts: int = 200
    every_steps: int = 0  # 0: only before and after RL
    temperature: float = 0.0
    max_new_tokens: int = 256

    def __post_init__(self):
        if self.max_prompts < 1:
            raise ConfigError(f"eval.max_prompts: must be >= 1, got {self.max_prompts}")
        if self.every_steps < 0:
            raise ConfigError(f"eval.every_steps: must be >= 0 (0: before and after RL "
                              f"only), got {self.every_steps}")
        _check_generation("eval", self.max_new_tokens, self.temperature)


@dataclasses.dataclass
class ProcessGroupConfig:
    """How trainer processes find each other with ``distributed: true``. Unset fields are read
    from the cluster's environment by ``jax.distributed`` (TPU pod metadata, SLURM, Open MPI);
    set all three to launch processes by hand (one per host, ``process_id`` 0 leads)."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    # a process not answering this long (killed, host down) ends the whole group
    heartbeat_timeout_s: int = 100
    # the longest wait at start for every process (then this one is aborted)
    join_timeout_s: int = 300
    # host:port process 0's coordination service listens on (unset: every interface, at the
    # coordinator's port); it takes no credentials: keep it on a private network
    bind_address: str | None = None
    # a trainer command (a step, a checkpoint, a snapshot) not finished on every process after
    # this long ends the run, naming the processes yet to finish it (null: no limit)
    command_timeout_s: float | None = 3600.0

    def __post_init__(self):
        if self.command_timeout_s is not None and not self.command_timeout_s >= 1:
            raise ConfigError(f"process_group.command_timeout_s: must be >= 1 or null, got "
                              f"{self.command_timeout_s}")
        if self.heartbeat_timeout_s < 2:
            raise ConfigError(f"process_group.heartbeat_timeout_s: must be >= 2, got "
                              f"{self.heartbeat_timeout_s}")
        if self.join_timeout_s < 1:
            raise ConfigError(f"process_group.join_timeout_s: must be >= 1, got "
                              f"{self.join_timeout_s}")
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise ConfigError(f"process_group.num_processes: must be >= 1, got {n}")
        if i is not None and (i < 0 or (n is not None and i >= n)):
            raise ConfigError(f"process_group.process_id: must be in [0, num_processes), got {i}")


@dataclasses.dataclass
class ExperimentConfig:
    run_dir: str
    model_path: str  # a Hugging Face directory, or "tiny"
    dataset: DatasetConfig
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    tiny: TinyModelSpec | None = None  # the tiny model's shape (model_path: tiny); see tiny_model
    synthetic: SyntheticConfig | None = None
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint_every: int = 10  # trainer steps
    trainer_cpus: list[int] | None = None  # pin the trainer process to these CPUs
    trainer_devices: list[int] | None = None  # accelerator ids the trainer uses (default: all)
    # XLA_PYTHON_CLIENT_MEM_FRACTION of the trainer process (JAX's default: 0.75 of each device);
    # where it and rollout.server_memory_fraction are unset and trainer and local servers share
    # a device, the processes start with shares that fit (memory_fractions)
    trainer_memory_fraction: float | None = None
    distributed: bool = False  # multi-process trainer: join a jax.distributed process group
    # XLA's deterministic GPU ops for the trainer and its compile helper (not the rollout
    # servers): the same config and seed give the same SFT weights run after run (GPU
    # scatter-adds otherwise accumulate in no fixed order); a CPU is deterministic already
    deterministic: bool = False
    process_group: ProcessGroupConfig = dataclasses.field(default_factory=ProcessGroupConfig)
    seed: int = 0
    # Persistent XLA compilation cache for the trainer and the servers it launches: unset uses
    # ~/.cache/areal-jax/xla (or $AREAL_JAX_CACHE_DIR); "" turns it off.
    compilation_cache_dir: str | None = None
    # Compile the train programs of sketched first batches while the rollout servers start and
    # the held-out set is evaluated; null: where that takes no CPU from the servers (remote
    # servers, an accelerator backend, disjoint trainer_cpus and rollout.cpu_sets, or the
    # trainer compiling ahead in its helper process at the lowest CPU priority).
    compile_first_batches: bool | None = None
    # Compile the local JAX-engine servers' programs into the persistent compilation cache while
    # SFT runs (in a process that exits before the servers start); null: where that takes no
    # CPU from SFT (an accelerator backend, or disjoint trainer_cpus and rollout.cpu_sets).
    compile_servers_during_sft: bool | None = None

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the sampled log-probs: ``sampling.temperature``, or 1 where it
        samples greedily (greedy answers report log-probs at temperature 1)."""
        t = self.sampling.temperature
        return t if t >= GREEDY_TEMPERATURE else 1.0

    @property
    def tiny_model(self) -> TinyModelSpec:
        """The shape ``model_path: tiny`` builds: the ``tiny`` section, or the defaults."""
        return self.tiny or TinyModelSpec()

    def __post_init__(self):
        # The trainer recomputes log-probs at its temperature; a mismatch would silently train
        # against a different policy than the one that sampled.
        # Greedy sampling (temperature 0, or below GREEDY_TEMPERATURE) reports log-probs at
        # temperature 1.
        sampled_at = self.logprob_temperature
        if self.trainer.temperature is not None and self.trainer.temperature != sampled_at:
            raise ConfigError(
                f"trainer.temperature ({self.trainer.temperature:g}) must equal "
                f"sampling.temperature ({sampled_at:g}) or be left unset"
            )
        if not 0 <= self.seed < MAX_SEED:
            raise ConfigError(f"seed: must be in [0, 2**32), got {self.seed}")
        estimator = self.trainer.advantage.estimator
        if estimator in GROUP_RELATIVE_ESTIMATORS and self.sampling.group_size < 2:
            raise ConfigError(
                f"sampling.group_size: trainer.advantage.estimator {estimator} compares each "
                f"answer with the others of its group, so it needs sampling.group_size >= 2 "
                f"(with {self.sampling.group_size} the reward gives every answer an advantage "
                "of 0: nothing is learned from it); raise it, or use estimator reinforce (a "
                "batch-mean baseline)")
        budget = self.trainer.max_new_tokens
        if budget is not None and budget != self.sampling.max_new_tokens:
            raise ConfigError(
                f"trainer.max_new_tokens ({budget}) must equal sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens}) or be left unset"
            )
        pg = self.process_group
        if not self.distributed and (pg.coordinator_address or pg.num_processes or
                                     pg.bind_address or pg.process_id is not None):
            raise ConfigError("process_group: set, but distributed is false (every process "
                              "would run as its own leader on the shared run_dir); set "
                              "distributed: true")
        trajectories = self.schedule.batch_size * self.sampling.group_size
        if self.trainer.ppo_n_minibatches > trajectories:
            raise ConfigError(
                f"trainer.ppo_n_minibatches ({self.trainer.ppo_n_minibatches}) is more than the "
                f"{trajectories} trajectories of a batch (schedule.batch_size x "
                "sampling.group_size)")
        if self.trainer.lr_schedule == "constant" and self.trainer.total_steps:
            raise ConfigError(
                f"trainer.total_steps ({self.trainer.total_steps}) is the cosine learning-rate "
                "schedule's horizon, in optimiser updates, and lr_schedule is constant: the "
                "run's length is schedule.total_steps (sft.steps for SFT); remove it, or set "
                "trainer.lr_schedule: cosine (left unset, its horizon is the whole run)")
        # the trainers' settings as resolved here, checked now rather than after prep (a typo
        # in sft.trainer is an error with sft.steps 0 too: it would surface only once SFT is
        # turned on)
        from_dict(TrainerConfig, self.trainer_fields(), "trainer")
        self.sft_trainer  # built here only to be checked
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every: must be >= 0 (0: never), got "
                              f"{self.checkpoint_every}")
        fraction = self.trainer_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"trainer_memory_fraction: must be in (0, 1], got {fraction}")
        self._check_shared_device_memory()
        if self.compile_servers_during_sft and self.compilation_cache_dir == "":
            raise ConfigError("compile_servers_during_sft: needs the persistent compilation "
                              "cache, which compilation_cache_dir: '' turns off")

    @property
    def sft_trainer(self) -> TrainerConfig:
        """The SFT warm start's trainer settings: ``trainer`` with ``sft.trainer`` on top."""
        return from_dict(TrainerConfig, self.trainer_fields(sft=True), "sft.trainer")

    def trainer_fields(self, sft: bool = False) -> dict[str, Any]:
        """The ``trainer`` section as plain data (``sft``: with ``sft.trainer`` applied on
        top), with ``max_new_tokens`` (the overlong penalty measures against it) and
        ``temperature`` (``logprob_temperature``) from ``sampling`` where unset, and a cosine
        schedule's unset horizon (``total_steps`` 0) the phase's optimiser updates: SFT's
        steps, or RL's versions times ``ppo_n_minibatches``."""
        data = to_dict(self.trainer)
        if data.get("max_new_tokens") is None:
            data["max_new_tokens"] = self.sampling.max_new_tokens
        if data.get("temperature") is None:
            data["temperature"] = self.logprob_temperature
        data.update(self.sft.trainer if sft else {})
        if data.get("lr_schedule") == "cosine" and not data.get("total_steps"):
            updates = self.sft.steps if sft else (
                self.schedule.total_steps * data.get("ppo_n_minibatches", 1))
            # a phase of no updates (its trainer built for an export, say) needs a valid one
            data["total_steps"] = updates or data.get("warmup_steps", 0) + 1
        return data

    def _jax_processes_by_device(self, with_trainer: bool = True
                                 ) -> dict[int | None, list[tuple[str, float | None]]]:
        """(setting, fraction) of each JAX process on each device: the trainer (unless not
        ``with_trainer``) and the local JAX-engine servers, by their device lists (a null list
        is every device). Keyed by the devices the lists name, or by None alone when every list
        is null. Empty where the servers are remote."""
        r = self.rollout
        if r.remote:
            return {}
        # (setting, fraction, device ids or None for every device) of each JAX process
        processes = [("trainer_memory_fraction", self.trainer_memory_fraction,
                      self.trainer_devices)] if with_trainer else []
        if r.server.get("engine", {}).get("kind", "jax") == "jax":
            processes += [("rollout.server_memory_fraction", r.server_memory_fraction, ids)
                          for ids in r.server_devices or [None] * r.num_local_servers]
        named = sorted({d for _, _, ids in processes for d in ids or []})
        return {device: [(name, fraction) for name, fraction, ids in processes
                         if ids is None or device in ids]
                for device in named or [None]}

    def memory_fractions(self, with_trainer: bool = True) -> tuple[float | None, float | None]:
        """The memory shares (trainer, each local server) to start the processes with: the
        fields as set; where neither is set (nor the environment's
        ``XLA_PYTHON_CLIENT_MEM_FRACTION``) and JAX processes share a device, shares that fit
        instead of each asking for JAX's 75%: the trainer ``SHARED_TRAINER_FRACTION``, the
        servers ``SHARED_SERVERS_FRACTION`` split among those on its device
        (``SERVERS_ALONE_FRACTION`` where no trainer is there). ``with_trainer=False``: for
        servers started without a trainer process (``areal-jax eval``). None: unset."""
        trainer, server = self.trainer_memory_fraction, self.rollout.server_memory_fraction
        if trainer is not None or server is not None or MEMORY_FRACTION_VARIABLE in os.environ:
            return trainer, server
        trainer_shares, server_shares = False, []
        for on_device in self._jax_processes_by_device(with_trainer).values():
            servers = sum(name != "trainer_memory_fraction" for name, _ in on_device)
            if len(on_device) < 2:
                continue
            if servers == len(on_device):
                server_shares.append(SERVERS_ALONE_FRACTION / servers)
            else:
                trainer_shares = True
                server_shares.append(SHARED_SERVERS_FRACTION / servers)
        return (SHARED_TRAINER_FRACTION if trainer_shares else None,
                round(min(server_shares), 4) if server_shares else None)

    def _check_shared_device_memory(self) -> None:
        """Where a memory fraction is set (a field, or the environment's variable), no device's
        JAX processes (the trainer and the local
        JAX-engine servers whose device lists include it; a null list means every device) may
        together claim more than all of its memory: the last to start would fail to allocate.
        An unset fraction counts as the environment's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else
        JAX's default 0.75. SGLang servers size their memory themselves and are not counted.
        With neither set nor the environment's variable, ``memory_fractions`` chooses shares
        that fit."""
        if (self.trainer_memory_fraction is None and self.rollout.server_memory_fraction is None
                and MEMORY_FRACTION_VARIABLE not in os.environ):
            return
        inherited = _environment_memory_fraction()
        for device, on_device in self._jax_processes_by_device().items():
            counts = collections.Counter(on_device)
            shares = {(name, fraction): inherited if fraction is None else fraction
                      for name, fraction in counts}
            total = sum(shares[key] * n for key, n in counts.items())
            if total > 1 + 1e-9:
                unset = (f"unset: {MEMORY_FRACTION_VARIABLE}=" if MEMORY_FRACTION_VARIABLE
                         in os.environ else "unset: ")
                parts = [f"{name} ({unset if fraction is None else ''}"
                         f"{shares[name, fraction]:g})" + (f" x {n}" if n > 1 else "")
                         for (name, fraction), n in counts.items()]
                where = "every device" if device is None else f"device {device}"
                raise ConfigError(
                    f"{' + '.join(parts)} on {where} = {total:g} > 1: lower the fractions or "
                    "give the processes separate devices (trainer_devices, rollout.server_devices)")
