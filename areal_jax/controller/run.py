"""``areal-jax train`` end to end, and who runs what.

Every trainer process: joins the process group (``distributed: true``), runs the SFT warm start
and restores the checkpoint (both collective), then either leads or follows. The leader
(process 0) alone prepares the run directory, owns the data, the staleness gate, the rollout
servers and publishing (``rl_phase``), and drives the other processes through a
``TrainerGroup``: they receive each batch and run the same jitted step on their devices until
the leader closes the group. Re-running the same command resumes from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from areal_jax.compilation import enable_compilation_cache
from areal_jax.controller.local_servers import MEMORY_FRACTION_VARIABLE, device_env
from areal_jax.controller.local_servers import with_deterministic_ops
from areal_jax.controller.prepare import check_fingerprint, prepare_base_model, prepare_data
from areal_jax.controller.prepare import base_model_path, changed_since_last_start
from areal_jax.controller.prepare import dataset_config, record_config, run_id
from areal_jax.controller.evaluation import held_out_items
from areal_jax.controller.progress import TrainingProgress
from areal_jax.controller.reward_watch import try_reward_before_sft
from areal_jax.controller.rl_phase import RESULTS_FILE, SAMPLES_DIR, check_trajectories_fit
from areal_jax.controller.rl_phase import run_rl
from areal_jax.controller.rl_phase import recorded_results, report_finished
from areal_jax.controller.run_lock import hold_run_dir
from areal_jax.controller.servers import check_local_engine_context, check_remote_servers
from areal_jax.controller.servers import servers_compiling
from areal_jax.controller.sft_phase import run_sft, sft_end_token, sft_examples
from areal_jax.controller.sft_phase import sft_model_kept
from areal_jax.controller.trainers import make_trainer
from areal_jax.data.dataset import PromptDataset
from areal_jax.config import ConfigError, to_dict
from areal_jax.experiment import ExperimentConfig
from areal_jax.files import remove_unfinished_writes, write_atomic
from areal_jax.stopping import run_stoppable


def claim_devices(cfg: ExperimentConfig, with_servers: bool = True) -> Callable[[], None]:
    """Pin CPUs, limit the accelerators and the memory share this process's JAX takes, and
    ask XLA for deterministic ops (``deterministic``, in ``XLA_FLAGS``, which its compile
    helper inherits; the rollout servers get them removed), before JAX starts its backends.
    Without servers (``areal-jax sft``) only a memory share the config sets applies. Returns
    the call that puts the memory-fraction variable back once JAX has read it, so the local
    servers this process starts get their own (``ExperimentConfig.memory_fractions``, else
    the launching environment's), not the trainer's."""
    if cfg.trainer_cpus:
        os.sched_setaffinity(0, cfg.trainer_cpus)
    before = os.environ.get(MEMORY_FRACTION_VARIABLE)
    trainer_fraction = cfg.memory_fractions()[0] if with_servers else cfg.trainer_memory_fraction
    os.environ.update(device_env(cfg.trainer_devices, trainer_fraction))
    if cfg.deterministic:
        os.environ["XLA_FLAGS"] = with_deterministic_ops(os.environ.get("XLA_FLAGS", ""), True)

    def release() -> None:
        if before is None:
            os.environ.pop(MEMORY_FRACTION_VARIABLE, None)
        else:
            os.environ[MEMORY_FRACTION_VARIABLE] = before

    return release


class _RunLogHandler(logging.Handler):
    """Records kept in memory until the run is accepted (``accept``), then written to the
    file, with those that follow: a run refused before that (a config the checks refuse,
    a run directory another process trains) writes nothing, neither a file of its own nor
    into the running run's."""

    MAX_HELD = 10_000  # records held before acceptance; the oldest are dropped past it

    def __init__(self, path: Path):
        super().__init__()
        self._path = path
        self._held: collections.deque[logging.LogRecord] = collections.deque(
            maxlen=self.MAX_HELD)
        self._file: logging.FileHandler | None = None

    @property
    def accepted(self) -> bool:
        return self._file is not None

    def accept(self) -> None:
        """Open the file and write the records held so far."""
        self.acquire()
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = logging.FileHandler(self._path)
            self._file.setFormatter(self.formatter)
            for record in self._held:
                self._file.handle(record)
            self._held.clear()
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            self._held.append(record)
        else:
            self._file.handle(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[Callable[[], None]]:
    """Keep this process's areal-jax messages from INFO up (programs compiled ahead, new
    micro-batch shapes, compiles per version, and every warning) for ``path``, written there
    once the run calls the function this yields (its run directory accepted) and from then on,
    with the error that stops the run; what reaches the console is left as it was (warnings
    and errors)."""
    handler = _RunLogHandler(path)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    loggers = [logging.getLogger(name) for name in ("areal_jax", "rollout")]
    levels = [logger.level for logger in loggers]
    console = [h for h in logging.getLogger().handlers if h.level == logging.NOTSET]
    for h in console:  # the root's level kept them to warnings; INFO now propagates to them
        h.setLevel(logging.getLogger().getEffectiveLevel())
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield handler.accept
    except BaseException as e:  # in the file too (the console shows the command's own line)
        if handler.accepted:
            handler.handle(loggers[0].makeRecord(
                loggers[0].name, logging.ERROR, __file__, 0, "the run stopped: %s: %s",
                (type(e).__name__, e), None if isinstance(e, KeyboardInterrupt) else
                (type(e), e, e.__traceback__)))
        raise
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        for h in console:
            h.setLevel(logging.NOTSET)
        handler.close()


def _report_default_memory_shares(cfg: ExperimentConfig) -> None:
    """Say which memory shares were chosen for processes sharing an accelerator when the
    config set none (on a CPU they mean nothing: say nothing)."""
    import jax

    unset = cfg.trainer_memory_fraction is None and cfg.rollout.server_memory_fraction is None
    trainer, server = cfg.memory_fractions()
    if jax.default_backend() == "cpu" or not unset or (trainer is None and server is None):
        return
    parts = [f"trainer {trainer:g}"] if trainer is not None else []
    parts += [f"each local rollout server {server:g}"] if server is not None else []
    print(f"processes share devices; memory shares: {', '.join(parts)} (set them with "
          "trainer_memory_fraction and rollout.server_memory_fraction)", flush=True)


def train(cfg: ExperimentConfig) -> dict:
    """Run (or resume) the experiment; returns the before/after evaluation results (on the
    leader; other processes return an empty dict)."""
    import jax

    from areal_jax.parallel.multihost import initialize_distributed, is_leader

    release_memory_fraction = claim_devices(cfg)
    enable_compilation_cache(cfg.compilation_cache_dir)
    if cfg.distributed:
        pg = cfg.process_group  # unset fields: from the cluster's environment
        initialize_distributed(pg.coordinator_address, pg.num_processes, pg.process_id,
                               pg.heartbeat_timeout_s, pg.join_timeout_s, pg.bind_address)
    leader = is_leader()  # JAX's backends start here and read the claim
    release_memory_fraction()
    name = "train.log" if leader else f"train_process{jax.process_index()}.log"
    with run_log(Path(cfg.run_dir) / "logs" / name) as accept_log, \
            contextlib.ExitStack() as held:
        return _train(cfg, leader, held, accept_log)


def _train(cfg: ExperimentConfig, leader: bool, held: contextlib.ExitStack,
           accept_log: Callable[[], None]) -> dict:
    """``train`` once this process has claimed its devices and joined the process group."""
    from areal_jax.parallel.multihost import failure_ends_group

    from areal_jax.parallel.trainer_group import TrainerGroup

    run_dir = Path(cfg.run_dir)
    with failure_ends_group(cfg.distributed):  # no process waits for a failed one
        _prepare(cfg, leader)
    with TrainingProgress(enabled=leader) as progress:
        with failure_ends_group(cfg.distributed):
            trainer, extra, tokenizer, train_set, eval_items = _start(
                cfg, leader, held, accept_log, progress)
        group = TrainerGroup(trainer, cfg.process_group.command_timeout_s)
        if not leader:
            try:
                group.follow()  # until the leader closes the group
            except BaseException:
                trainer.close()
                raise
            return {}
        try:
            if extra is not None:
                print(f"resumed from checkpoint at version {trainer.version}", flush=True)
                if trainer.version >= cfg.schedule.total_steps and (
                        recorded := recorded_results(cfg, trainer.version)) is not None:
                    report_finished(cfg, recorded)  # no servers started to measure it again
                    return recorded
            t0 = time.monotonic()
            results = run_stoppable(run_rl(cfg, group, tokenizer, train_set, eval_items,
                                           progress, extra))
        finally:
            group.close()  # releases the other processes, closes the trainer
    results["wall_s"] = time.monotonic() - t0
    write_atomic(run_dir / RESULTS_FILE, json.dumps(results, indent=2))
    return results


# Settings a trainer process may set for its own host; every other setting, and the code,
# must be the leader's (each process builds its trainer from its own config and command line,
# and a process stepping its shards with another learning rate trains silently wrong weights).
HOST_SETTINGS = ("process_group", "trainer_cpus", "trainer_devices", "trainer_memory_fraction",
                 "compilation_cache_dir")


def check_same_config(cfg: ExperimentConfig) -> None:
    """Every trainer process runs the leader's settings (but ``HOST_SETTINGS``) and the same
    areal-jax code; where one differs, every process raises ``ConfigError`` together, the one
    that differs naming the settings."""
    from areal_jax.parallel.multihost import differences_from_leader, peer_failures

    settings = {k: v for k, v in to_dict(cfg).items() if k not in HOST_SETTINGS}
    settings["areal-jax source"] = _source_digest()
    differ, agreed = differences_from_leader(settings)
    if agreed:
        return
    shared = ", ".join(HOST_SETTINGS)
    if differ:
        raise ConfigError(f"this trainer process's settings differ from the leader's (process "
                          f"0) at: {', '.join(differ)}; every process must run the same config "
                          f"and code (only {shared} may differ)")
    raise ConfigError(f"another trainer process's settings differ from this one's: "
                      f"{'; '.join(peer_failures()) or 'see its log'}; every process must run "
                      f"the same config and code (only {shared} may differ)")


def _source_digest() -> str:
    """SHA-256 of the areal_jax package's Python sources."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _prepare(cfg: ExperimentConfig, leader: bool) -> None:
    """Every process checks it runs the leader's config; the leader prepares the data and the
    base model while the others wait."""
    from jax.experimental.multihost_utils import sync_global_devices as barrier

    check_same_config(cfg)
    if leader:
        _report_default_memory_shares(cfg)
        prepare_data(cfg)
        prepare_base_model(cfg)
    barrier("data and base model prepared")


def _start(cfg: ExperimentConfig, leader: bool, held: contextlib.ExitStack,
           accept_log: Callable[[], None], progress: TrainingProgress) -> tuple:
    """Every process: the leader holds the run directory (``hold_run_dir``) in ``held`` once
    the config is accepted by the checks that read it, and from then on every process writes
    its log (``accept_log``); then SFT, the trainer and its restored checkpoint. Returns
    ``(trainer, extra, tokenizer, train_set, eval_items)``."""
    from jax.experimental.multihost_utils import sync_global_devices as barrier

    from areal_jax.models import ModelConfig
    from areal_jax.models.tokenizer import load_tokenizer

    run_dir = Path(cfg.run_dir)
    base = base_model_path(cfg)
    tokenizer = load_tokenizer(base, ModelConfig.from_pretrained(base).vocab_size, "model_path")
    # Checked before SFT, and before the run directory records this config: a config
    # refused here can be corrected in place.
    train_set = PromptDataset(dataset_config(cfg.dataset, cfg.run_dir), tokenizer)
    prompt_lengths = [len(item.prompt_ids) for item in train_set]
    check_trajectories_fit(cfg, prompt_lengths)
    eval_items = held_out_items(cfg, tokenizer)
    check_local_engine_context(cfg, base, training=prompt_lengths,
                               held_out=[len(item.prompt_ids) for item in eval_items])
    sft_pending = bool(cfg.sft.steps) and not sft_model_kept(cfg)
    examples = sft_examples(cfg, tokenizer, train_set, sft_end_token(base, tokenizer)
                            ) if sft_pending else []
    if leader and sft_pending:
        try_reward_before_sft(cfg, train_set)
    if leader:
        run_dir.mkdir(parents=True, exist_ok=True)  # a config refused before: no run_dir
        held.enter_context(hold_run_dir(run_dir, "train"))  # before it reads or writes it
        for directory in (run_dir, run_dir / SAMPLES_DIR):  # a killed run's, half written
            remove_unfinished_writes(directory)
        check_fingerprint(cfg)  # a refused config leaves the run's config.json as it was
        if changed := changed_since_last_start(cfg):
            print(f"settings changed since {run_dir} last started: {'; '.join(changed)}",
                  flush=True)
        record_config(cfg)
    barrier("run directory prepared")
    accept_log()
    if leader and sft_pending:  # a remote server that cannot serve the run: named now
        asyncio.run(check_remote_servers(
            cfg, base, training=prompt_lengths, run_id=run_id(cfg),
            held_out=[len(item.prompt_ids) for item in eval_items]))
    start = base
    if cfg.sft.steps:
        with servers_compiling(cfg, base, leader and sft_pending):
            start = run_sft(cfg, base, examples, progress, leader, barrier)
    trainer = make_trainer(cfg, start)
    try:
        extra = trainer.restore()  # every process, from the same checkpoint
    except BaseException:
        trainer.close()
        raise
    return trainer, extra, tokenizer, train_set, eval_items
