"""The supervised warm start: a few hundred steps on the training prompts' reference responses
(``metadata[sft.response_key]``), exported as the HF model RL starts from.

Every trainer process runs it (the batches are deterministic, so each builds the same ones);
the leader writes ``<run_dir>/sft_model``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from areal_jax.config import ConfigError
from areal_jax.controller.prepare import dataset_config
from areal_jax.controller.progress import TrainingProgress
from areal_jax.controller.trainers import make_trainer
from areal_jax.data.dataset import PromptDataset, metadata_text
from areal_jax.experiment import ExperimentConfig
from areal_jax.metrics import MetricsLogger
from areal_jax.models import ModelConfig, export_hf_tensors
from areal_jax.models.config import generation_eos_ids
from areal_jax.models.hf_export import remove_unfinished_exports

log = logging.getLogger(__name__)


def sft_end_token(model_path: Path, tokenizer) -> int:
    """The token SFT ends each response with: the tokenizer's end token where the model stops
    on it (``config.json``'s and ``generation_config.json``'s end ids, which the rollout servers
    stop on), else the model's first end id (config.json's first, then
    generation_config.json's), with a warning: a model taught to end with a
    token generation does not stop on would run every answer to ``max_new_tokens``.
    ConfigError when the model lists no end id at all."""
    cfg = ModelConfig.from_pretrained(model_path)
    stops = list(dict.fromkeys([*cfg.eos_token_ids,
                                *generation_eos_ids(model_path, cfg.vocab_size)]))
    if tokenizer.eos_token_id in stops:
        return tokenizer.eos_token_id
    if not stops:
        raise ConfigError(
            f"model_path: {model_path} lists no end-of-sequence id (eos_token_id in config.json "
            "or generation_config.json), so generation would run every answer to its "
            "max_new_tokens; set the id of the token your answers end with there")
    log.warning("the tokenizer's end token %r (id %s) is not one the model stops on (%s, from "
                "config.json and generation_config.json): SFT ends each answer with id %d, "
                "the one generation stops on", tokenizer.eos_token, tokenizer.eos_token_id,
                stops, stops[0])
    return stops[0]


def sft_examples(cfg: ExperimentConfig, tokenizer, dataset: PromptDataset | None = None,
                 end_id: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + ``end_id``) for every training prompt (``dataset``, when the
    caller has read it already; ``end_id``: ``sft_end_token``'s choice, default the
    tokenizer's end token); refuses a response key the dataset does not read, and, naming
    the prompt, an empty response and one whose prompt + response fits no SFT micro-batch (its
    step would fail mid-SFT, after the steps before it). The dataset refuses null values
    itself."""
    key = cfg.sft.response_key
    if key not in cfg.dataset.metadata_fields:
        raise ConfigError(
            f"sft.response_key: {key!r} is not a key of dataset.metadata_fields "
            f"{dict(cfg.dataset.metadata_fields)}; SFT trains on that field of the RL dataset, "
            "so list it there")
    if dataset is None:
        dataset = PromptDataset(dataset_config(cfg.dataset, cfg.run_dir), tokenizer)
    budget = cfg.sft_trainer.micro_batch.token_budget
    end = tokenizer.eos_token_id if end_id is None else end_id
    examples = []
    for item in dataset:
        text = metadata_text(item.metadata[key])
        if not text.strip():
            raise ConfigError(
                f"sft.response_key: prompt {item.id}'s {key!r} is empty: SFT would teach the "
                "model to answer it with nothing; fill or drop that row")
        response = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = [*response, end]
        if len(item.prompt_ids) + len(response) > budget:
            raise ConfigError(
                f"sft.response_key: prompt {item.id}'s prompt ({len(item.prompt_ids)} tokens) + "
                f"{key!r} ({len(response)} tokens) is over the SFT micro-batch token budget "
                f"({budget}, trainer.micro_batch.token_budget or sft.trainer's): it fits no "
                "micro-batch; raise the budget, or shorten or drop that row")
        examples.append((item.prompt_ids, response))
    return examples


def sft_model_kept(cfg: ExperimentConfig) -> bool:
    """Whether an earlier run already wrote the SFT model (``run_sft`` then keeps it)."""
    return (Path(cfg.run_dir) / "sft_model" / "config.json").is_file()


def run_sft(cfg: ExperimentConfig, base: Path, examples: list, progress: TrainingProgress,
            leader: bool = True, barrier=lambda name: None) -> Path:
    """Supervised warm start on ``examples`` (``sft_examples``); returns
    ``<run_dir>/sft_model`` (kept when it already exists)."""
    out = Path(cfg.run_dir) / "sft_model"
    if sft_model_kept(cfg):
        return out
    trainer = make_trainer(cfg, base, sft=True, run_dir=Path(cfg.run_dir) / "sft")
    try:
        task = progress.start_phase("SFT warm start", cfg.sft.steps)
        n, bs = len(examples), cfg.sft.batch_size
        # The leader alone writes the metrics (every process computes the same ones). SFT keeps
        # no checkpoint: a re-run after a kill starts over at step 1, and so do its metrics.
        metrics_dir = Path(cfg.run_dir) / "sft"
        with MetricsLogger(metrics_dir, resume_from_step=1) if leader \
                else contextlib.nullcontext() as metrics:
            for step in range(cfg.sft.steps):
                start = (step * bs) % n
                batch = [examples[(start + i) % n] for i in range(bs)]
                m = trainer.sft_on_batch(batch)
                if metrics is not None:
                    metrics.log(step + 1, m)
                progress.advance(task, {"loss": m.get("loss", float("nan"))})
        progress.end_phase(task)
        snapshot = trainer.snapshot_for_publish()  # collective: every process takes part
        if leader:  # synced to disk: kept by every later run, it is never written again
            remove_unfinished_exports(out.parent, out.name)  # of a killed earlier run
            export_hf_tensors(snapshot.tensors, snapshot.model_cfg, out,
                              tokenizer_dir=snapshot.tokenizer_dir,
                              source_dir=snapshot.source_dir, durable=True)
        barrier("sft_model written")
    finally:
        trainer.close()
    return out
