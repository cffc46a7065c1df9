"""Every shipped experiment config parses into the typed config (no unknown or ill-typed key)."""

from pathlib import Path

import pytest

from areal_jax.config import load_config
from areal_jax.experiment import ExperimentConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses(path):
    cfg = load_config(ExperimentConfig, path)
    assert cfg.schedule.batch_size >= 1
    if "gsm8k" in path.stem:
        assert cfg.dataset.reward == "math"
        assert cfg.dataset.instruction_suffix.endswith("\\boxed{}.")
        assert cfg.rollout.server["engine"]["kind"] in ("jax", "sglang")


def test_sync_mode_forces_zero_staleness():
    cfg = load_config(ExperimentConfig, CONFIGS[0], ["schedule.mode=sync", "schedule.max_staleness=4"])
    assert cfg.schedule.max_staleness == 0
