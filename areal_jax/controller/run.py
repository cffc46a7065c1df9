"""``areal-jax train`` end to end: prepare model and data, optional SFT warm start, launch or
attach rollout servers, evaluate, run the asynchronous RL loop, evaluate again. Re-running the
same command resumes from the last checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from areal_jax.config import from_dict, to_dict
from areal_jax.controller.evaluation import evaluate
from areal_jax.controller.local_servers import LocalServers
from areal_jax.controller.loop import RLLoop
from areal_jax.controller.progress import TrainingProgress
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.data.config import DatasetConfig
from areal_jax.data.dataset import PromptDataset
from areal_jax.experiment import ExperimentConfig
from areal_jax.metrics import MetricsLogger

log = logging.getLogger(__name__)


def _fill(text: str, run_dir: str) -> str:
    return text.replace("{run_dir}", run_dir)


def _dataset_cfg(cfg: DatasetConfig, run_dir: str) -> DatasetConfig:
    return dataclasses.replace(cfg, path=_fill(cfg.path, run_dir))


def prepare_base_model(cfg: ExperimentConfig) -> Path:
    """The HF directory RL (or SFT) starts from; ``tiny`` builds the kit once into the run dir."""
    if cfg.model_path != "tiny":
        path = Path(_fill(cfg.model_path, cfg.run_dir))
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model_path: {path} has no config.json")
        return path
    path = Path(cfg.run_dir) / "base_model"
    if not (path / "config.json").is_file():
        from areal_jax.models.tiny import build_tiny_model

        build_tiny_model(path, cfg.tiny)
    return path


def prepare_data(cfg: ExperimentConfig) -> None:
    """Write the synthetic task's files into the run dir when configured (idempotent)."""
    if cfg.synthetic is None:
        return
    from areal_jax.data.synthetic import write_synthetic_splits

    out = Path(cfg.run_dir) / "data"
    if not (out / "train.jsonl").is_file():
        write_synthetic_splits(out, cfg.synthetic)


def starting_model(cfg: ExperimentConfig) -> Path:
    """The HF directory RL starts from: the SFT warm start when configured, else the base."""
    return Path(cfg.run_dir) / "sft_model" if cfg.sft.steps > 0 else prepare_base_model(cfg)


def make_trainer(cfg: ExperimentConfig, model_path: Path, overrides: dict | None = None,
                 run_dir: Path | None = None):
    """A Trainer for ``model_path`` with the experiment's trainer config (plus overrides)."""
    from areal_jax.trainer import Trainer
    from areal_jax.trainer.config import TrainerConfig

    data = to_dict(cfg.trainer)
    if data.get("max_new_tokens") is None:  # the overlong penalty measures against it
        data["max_new_tokens"] = cfg.sampling.max_new_tokens
    data.update(overrides or {})
    data["model_path"] = str(model_path)
    data["run_dir"] = str(run_dir or cfg.run_dir)
    return Trainer(from_dict(TrainerConfig, data))


def run_sft(cfg: ExperimentConfig, base: Path, tokenizer, progress: TrainingProgress) -> Path:
    """Supervised warm start on the training prompts' reference responses; returns the HF dir."""
    out = Path(cfg.run_dir) / "sft_model"
    if (out / "config.json").is_file():
        return out
    dataset = PromptDataset(_dataset_cfg(cfg.dataset, cfg.run_dir), tokenizer)
    key = cfg.sft.response_key
    examples = []
    for item in dataset:
        if key not in item.metadata:
            raise KeyError(f"sft.response_key: prompt {item.id} has no metadata {key!r}")
        response = tokenizer(str(item.metadata[key]) + tokenizer.eos_token,
                             add_special_tokens=False)["input_ids"]
        examples.append((item.prompt_ids, response))
    from areal_jax.models import export_hf

    trainer = make_trainer(cfg, base, cfg.sft.trainer, run_dir=Path(cfg.run_dir) / "sft")
    try:
        task = progress.start_phase("SFT warm start", cfg.sft.steps)
        n, bs = len(examples), cfg.sft.batch_size
        with MetricsLogger(Path(cfg.run_dir) / "sft") as metrics:
            for step in range(cfg.sft.steps):
                start = (step * bs) % n
                batch = [examples[(start + i) % n] for i in range(bs)]
                m = trainer.sft_on_batch(batch)
                metrics.log(step + 1, m)
                progress.advance(task, {"loss": m.get("loss", float("nan"))})
        progress.end_phase(task)
        export_hf(trainer.model, out, tokenizer_dir=base)
    finally:
        trainer.close()
    return out


def _server_config(cfg: ExperimentConfig, model_path: Path, version: int) -> dict:
    server = dict(cfg.rollout.server)
    engine = dict(server.pop("engine", {}))
    engine.update({"model_path": str(model_path), "initial_version": version})
    engine.setdefault("kind", "jax")
    server["engine"] = engine
    if cfg.rollout.auth_token_env:
        server["auth_token_env"] = cfg.rollout.auth_token_env
    return server


def _make_pool(cfg: ExperimentConfig, addresses: list[str]) -> RolloutPool:
    token = os.environ.get(cfg.rollout.auth_token_env) if cfg.rollout.auth_token_env else None
    tls = Path(cfg.rollout.tls_root_cert).read_bytes() if cfg.rollout.tls_root_cert else None
    return RolloutPool(addresses, auth_token=token, tls_root_cert=tls)


def _print_eval(label: str, result: dict) -> None:
    print(f"{label}: accuracy {result['eval/accuracy']:.3f} on "
          f"{int(result['eval/num_prompts'])} held-out prompts "
          f"(mean response {result['eval/response_length']:.1f} tokens)", flush=True)


async def _train_async(cfg: ExperimentConfig, trainer, tokenizer, progress, extra) -> dict:
    run_dir = Path(cfg.run_dir)
    train_set = PromptDataset(_dataset_cfg(cfg.dataset, cfg.run_dir), tokenizer)
    eval_items = []
    if cfg.eval.dataset is not None:
        eval_set = PromptDataset(_dataset_cfg(cfg.eval.dataset, cfg.run_dir), tokenizer)
        eval_items = list(eval_set)[: cfg.eval.max_prompts]
    log.info("training prompts: %d (%d dropped as too long)", len(train_set), train_set.num_dropped)

    version = trainer.version
    published = trainer.publish(version)
    servers = None
    addresses = list(cfg.rollout.addresses)
    if not addresses:
        servers = LocalServers(_server_config(cfg, published, version), cfg.rollout.num_local_servers,
                               run_dir / "logs", cfg.rollout.cpu_sets)
        addresses = servers.start()
    pool = _make_pool(cfg, addresses)
    results: dict = {}
    try:
        task = progress.start_phase("starting rollout servers", None)
        await _wait_ready(pool, servers)
        progress.end_phase(task)
        if servers is None:
            await _sync_external_servers(pool, published, version, cfg)

        async def run_eval(step: int) -> dict:
            if not eval_items:
                return {}
            return await evaluate(pool, eval_items, cfg.eval.dataset.reward,
                                  max_new_tokens=cfg.eval.max_new_tokens,
                                  temperature=cfg.eval.temperature)

        metrics_log = MetricsLogger(run_dir, resume_from_step=version + 1)
        if eval_items:
            results["before"] = await run_eval(version)
            metrics_log.log(version, results["before"])
            _print_eval(f"held-out accuracy at version {version} (before RL)", results["before"])
        prompts = train_set.iterator()
        loop = RLLoop(cfg, trainer, pool, prompts, {i.id: i for i in train_set},
                      on_step=None, on_eval=run_eval)
        if extra:
            loop.load_state_dict(extra)
        total = cfg.schedule.total_steps
        task = progress.start_phase("RL", total, completed=version)

        def on_step(step: int, m: dict) -> None:
            metrics_log.log(step, m)
            progress.advance(task, m)

        loop.on_step = on_step
        ckpt = lambda state: trainer.save(state)
        await loop.run(total, ckpt)
        progress.end_phase(task)
        if eval_items:
            results["after"] = await run_eval(trainer.version)
            metrics_log.log(trainer.version, results["after"])
            _print_eval(f"held-out accuracy at version {trainer.version} (after RL)",
                        results["after"])
        metrics_log.close()
    finally:
        await pool.close()
        if servers is not None:
            servers.stop()
    return results


async def _wait_ready(pool: RolloutPool, servers: LocalServers | None, timeout_s: float = 300) -> None:
    start = asyncio.create_task(pool.start(ready_timeout_s=timeout_s))
    while not start.done():
        if servers is not None:
            try:
                servers.check_alive()
            except RuntimeError:
                start.cancel()
                raise
        await asyncio.sleep(0.5)
    await start


async def _sync_external_servers(pool: RolloutPool, path: Path, version: int, cfg) -> None:
    """Bring externally started servers to the trainer's version (after SFT or a restart)."""
    if version > 0 and any(s.version < version for s in await pool.status()):
        await pool.update_weights(path, version, push=cfg.rollout.weights_transport == "push")


async def evaluate_checkpoint(cfg: ExperimentConfig, model_path: Path) -> dict:
    """Held-out accuracy of the HF checkpoint ``model_path`` through local or given servers."""
    from transformers import AutoTokenizer

    if cfg.eval.dataset is None:
        raise ValueError("eval.dataset: required for evaluation")
    prepare_data(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    items = list(PromptDataset(_dataset_cfg(cfg.eval.dataset, cfg.run_dir), tokenizer))
    items = items[: cfg.eval.max_prompts]
    servers = None
    addresses = list(cfg.rollout.addresses)
    if not addresses:
        servers = LocalServers(_server_config(cfg, model_path, 0), cfg.rollout.num_local_servers,
                               Path(cfg.run_dir) / "logs", cfg.rollout.cpu_sets)
        addresses = servers.start()
    pool = _make_pool(cfg, addresses)
    try:
        await _wait_ready(pool, servers)
        if servers is None:
            await pool.update_weights(model_path, max(s.version for s in await pool.status()) + 1)
        return await evaluate(pool, items, cfg.eval.dataset.reward,
                              max_new_tokens=cfg.eval.max_new_tokens,
                              temperature=cfg.eval.temperature)
    finally:
        await pool.close()
        if servers is not None:
            servers.stop()


def train(cfg: ExperimentConfig) -> dict:
    """Run (or resume) the experiment; returns the before/after evaluation results."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if cfg.trainer_cpus:
        os.sched_setaffinity(0, cfg.trainer_cpus)
    if cfg.distributed:
        import jax

        jax.distributed.initialize()  # coordinator, process count and id from the environment
    progress = TrainingProgress()
    with progress:
        prepare_data(cfg)
        base = prepare_base_model(cfg)
        tokenizer = AutoTokenizer.from_pretrained(base)
        start = run_sft(cfg, base, tokenizer, progress) if cfg.sft.steps > 0 else base
        trainer = make_trainer(cfg, start)
        try:
            extra = trainer.restore()
            if extra is not None:
                print(f"resumed from checkpoint at version {trainer.version}", flush=True)
            t0 = time.monotonic()
            results = asyncio.run(_train_async(cfg, trainer, tokenizer, progress, extra))
        finally:
            trainer.close()
    results["wall_s"] = time.monotonic() - t0
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results
