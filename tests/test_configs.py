"""Every shipped experiment config parses into the typed config (no unknown or ill-typed key)."""

from pathlib import Path

import pytest

from areal_jax.config import ConfigError, load_config
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


def test_trainer_temperature_must_match_sampling():
    quickstart = CONFIGS[-1]
    assert quickstart.stem == "quickstart"
    with pytest.raises(ConfigError, match=r"trainer.temperature \(1\) must equal sampling.temperature \(0.7\)"):
        load_config(ExperimentConfig, quickstart, ["sampling.temperature=0.7"])
    assert load_config(ExperimentConfig, quickstart,
                       ["sampling.temperature=0.7", "trainer.temperature=0.7"]).trainer.temperature == 0.7
    with pytest.raises(ConfigError, match=r"trainer.max_new_tokens \(5\) must equal"):
        load_config(ExperimentConfig, quickstart, ["trainer.max_new_tokens=5"])


def test_cli_reports_config_errors_without_traceback(capsys):
    from areal_jax.cli import main

    assert main(["train", "--config", str(CONFIGS[-1]), "sampling.temperature=0.7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-jax train: error: trainer.temperature (1) must equal")
    assert "Traceback" not in err
