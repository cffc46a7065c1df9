"""``areal-jax sft --config CONFIG [key=value ...]``: the supervised warm start alone."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

NAME = "sft"
HELP = "Supervised fine-tuning on the dataset's reference responses; writes RUN_DIR/sft_model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment YAML (its sft section)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def run(args: argparse.Namespace) -> int:
    from areal_jax.compilation import enable_compilation_cache
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.progress import TrainingProgress
    from areal_jax.controller.prepare import check_fingerprint, prepare_base_model, prepare_data
    from areal_jax.controller.prepare import dataset_config, record_config
    from areal_jax.controller.reward_watch import try_reward_before_sft
    from areal_jax.controller.run import claim_devices
    from areal_jax.controller.run_lock import hold_run_dir
    from areal_jax.controller.sft_phase import run_sft, sft_end_token, sft_examples
    from areal_jax.controller.sft_phase import sft_model_kept
    from areal_jax.data.dataset import PromptDataset
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.models import ModelConfig
    from areal_jax.models.tokenizer import load_tokenizer

    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    if cfg.sft.steps < 1:
        raise ConfigError(f"sft.steps: must be >= 1 for `areal-jax sft`, got {cfg.sft.steps}")
    if cfg.distributed:  # each process would run its own SFT into the same sft_model
        raise ConfigError("distributed: `areal-jax sft` runs on one process; with distributed: "
                          "true, `areal-jax train` runs the SFT warm start across the processes")
    claim_devices(cfg, with_servers=False)  # no servers: the trainer's share stays set
    enable_compilation_cache(cfg.compilation_cache_dir)
    run_dir = Path(cfg.run_dir)
    made = not run_dir.exists()
    try:
        prepare_data(cfg)
        base = prepare_base_model(cfg)
        # a finished SFT is kept (run_sft): its examples are not read again
        tokenizer = load_tokenizer(base, ModelConfig.from_pretrained(base).vocab_size,
                                   "model_path")
        examples = []
        if not sft_model_kept(cfg):
            train_set = PromptDataset(dataset_config(cfg.dataset, cfg.run_dir), tokenizer)
            examples = sft_examples(cfg, tokenizer, train_set, sft_end_token(base, tokenizer))
            try_reward_before_sft(cfg, train_set)  # before its data settings are recorded
    except BaseException:
        if made:  # a refused config leaves no run directory behind, as `train`'s
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    run_dir.mkdir(parents=True, exist_ok=True)
    with hold_run_dir(run_dir, "sft"):
        check_fingerprint(cfg)  # the SFT model `train` would reuse must be this config's
        record_config(cfg)  # a train refused later names what it changed against this
        with TrainingProgress() as progress:
            out = run_sft(cfg, base, examples, progress)
    print(f"wrote {out}")
    return 0
