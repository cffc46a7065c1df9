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
import json
import os
import time
from pathlib import Path

from areal_jax.config import to_dict
from areal_jax.controller.local_servers import device_env
from areal_jax.controller.prepare import check_fingerprint, prepare_base_model, prepare_data
from areal_jax.controller.prepare import base_model_path
from areal_jax.controller.progress import TrainingProgress
from areal_jax.controller.rl_phase import run_rl
from areal_jax.controller.sft_phase import run_sft
from areal_jax.controller.trainers import make_trainer
from areal_jax.experiment import ExperimentConfig


def _claim_devices(cfg: ExperimentConfig) -> None:
    """Pin CPUs and limit the accelerators this process sees, before JAX starts its backends."""
    if cfg.trainer_cpus:
        os.sched_setaffinity(0, cfg.trainer_cpus)
    if cfg.trainer_devices is not None:
        os.environ.update(device_env(cfg.trainer_devices, None))


def train(cfg: ExperimentConfig) -> dict:
    """Run (or resume) the experiment; returns the before/after evaluation results (on the
    leader; other processes return an empty dict)."""
    from transformers import AutoTokenizer

    from areal_jax.parallel.multihost import TrainerGroup, barrier, initialize_distributed
    from areal_jax.parallel.multihost import is_leader

    _claim_devices(cfg)
    if cfg.distributed:
        initialize_distributed()  # coordinator, process count and id from the environment
    leader = is_leader()
    run_dir = Path(cfg.run_dir)
    if leader:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        prepare_data(cfg)
        prepare_base_model(cfg)
        check_fingerprint(cfg)
    barrier("run directory prepared")
    t0 = time.monotonic()
    with TrainingProgress(enabled=leader) as progress:
        base = base_model_path(cfg)
        tokenizer = AutoTokenizer.from_pretrained(base)
        start = run_sft(cfg, base, tokenizer, progress, leader, barrier) if cfg.sft.steps else base
        trainer = make_trainer(cfg, start)
        group = TrainerGroup(trainer)
        try:
            extra = trainer.restore()
            if not leader:
                group.follow()
                return {}
            if extra is not None:
                print(f"resumed from checkpoint at version {trainer.version}", flush=True)
            results = asyncio.run(run_rl(cfg, group, tokenizer, progress, extra))
        finally:
            group.close()
            trainer.close()
    results["wall_s"] = time.monotonic() - t0
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results
