"""Every shipped experiment config parses into the typed config (no unknown or ill-typed key)."""

import os
import shlex
from pathlib import Path

import pytest
import yaml

from areal_jax.config import ConfigError, from_dict, load_config
from areal_jax.experiment import ExperimentConfig
from areal_jax.trainer.config import TrainerConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
QUICKSTART = next(p for p in CONFIGS if p.stem == "quickstart")


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


def test_the_cosine_horizon_is_the_phase_unless_set_and_constant_refuses_one():
    # trainer.total_steps=3 with the default constant schedule was accepted and did nothing
    # (the run went to schedule.total_steps); cosine without it failed with "total_steps (0)
    # must exceed warmup_steps (0)", naming no value to use.
    with pytest.raises(ConfigError, match=r"trainer.total_steps \(3\) is the cosine .* "
                                          r"the run's length is schedule.total_steps"):
        load_config(ExperimentConfig, QUICKSTART, ["trainer.total_steps=3"])
    cfg = load_config(ExperimentConfig, QUICKSTART, [
        "trainer.lr_schedule=cosine", "schedule.total_steps=30", "trainer.ppo_n_minibatches=2",
        "sft.steps=40"])
    assert cfg.trainer_fields()["total_steps"] == 60  # 30 versions x 2 updates each
    assert cfg.sft_trainer.total_steps == 40  # one update per SFT step
    # No RL versions (SFT, then an export): its trainer is built all the same.
    from areal_jax.trainer.optimizer import lr_schedule
    none = load_config(ExperimentConfig, QUICKSTART, ["trainer.lr_schedule=cosine",
                                                      "schedule.total_steps=0"])
    lr_schedule(from_dict(TrainerConfig, none.trainer_fields()))
    set_ = load_config(ExperimentConfig, QUICKSTART, ["trainer.lr_schedule=cosine",
                                                      "trainer.total_steps=100"])
    assert set_.trainer_fields()["total_steps"] == 100
    with pytest.raises(ConfigError, match=r"trainer: total_steps \(10\) must exceed "
                                          r"warmup_steps \(20\) for the cosine schedule"):
        load_config(ExperimentConfig, QUICKSTART, [
            "trainer.lr_schedule=cosine", "trainer.warmup_steps=20", "schedule.total_steps=5"])


def test_trainer_temperature_follows_sampling_unless_set_otherwise():
    # Left at 1.0 by default, every sampling.temperature other than 1 was an error until the
    # trainer's was set to the same.
    quickstart = QUICKSTART
    cfg = load_config(ExperimentConfig, quickstart, ["sampling.temperature=0.7"])
    assert cfg.trainer.temperature is None and cfg.trainer_fields()["temperature"] == 0.7
    assert cfg.sft_trainer.logprob_temperature == 0.7
    greedy = load_config(ExperimentConfig, quickstart, ["sampling.temperature=0"])
    assert greedy.trainer_fields()["temperature"] == 1.0  # greedy answers report T = 1
    with pytest.raises(ConfigError, match=r"trainer.temperature \(1\) must equal sampling."
                                          r"temperature \(0.7\) or be left unset"):
        load_config(ExperimentConfig, quickstart, ["sampling.temperature=0.7",
                                                   "trainer.temperature=1.0"])
    assert load_config(ExperimentConfig, quickstart,
                       ["sampling.temperature=0.7", "trainer.temperature=0.7"]).trainer.temperature == 0.7
    with pytest.raises(ConfigError, match=r"trainer.max_new_tokens \(5\) must equal"):
        load_config(ExperimentConfig, quickstart, ["trainer.max_new_tokens=5"])


@pytest.mark.parametrize("override, message", [
    ("eval.max_new_tokens=0", "eval.max_new_tokens: must be >= 1, got 0"),
    ("eval.temperature=-1", "eval.temperature: must be finite and >= 0, got -1"),
    ("eval.temperature=.inf", "eval.temperature: expected a finite number, got inf"),
    ("eval.max_prompts=-5", "eval.max_prompts: must be >= 1, got -5"),
    ("eval.every_steps=-3", "eval.every_steps: must be >= 0"),
    ("checkpoint_every=-1", "checkpoint_every: must be >= 0"),
    ("sampling.top_p=0", r"sampling.top_p: must be in \(0, 1\], got 0"),
    ("sampling.top_k=0", "sampling.top_k: must be -1"),
    ("sampling.temperature=.nan", "sampling.temperature: expected a finite number, got nan"),
    ("trainer.advantage.estimator=rloo sampling.group_size=1",
     "estimator rloo compares each answer with the others of its group, so it needs "
     "sampling.group_size >= 2"),
    # GRPO (the default) trained every version of such a run with a zero gradient
    # YAML's readings of text a user meant literally, named with what to write instead
    ("dataset.metadata_fields={gold:gold}", r"'gold:gold' must map to a column name \(YAML "
     r"reads \{a:b\} as one key 'a:b': write \{a: b\}"),
    ("'dataset.system_prompt=Be brief: answer'", r"dataset.system_prompt: expected a string, "
     r"got \{'Be brief': 'answer'\} \(YAML reads 'text: more' as a mapping: quote"),
    ("sampling.group_size=1", r"estimator grpo .* \(with 1 the reward gives every answer an "
     r"advantage of 0: nothing is learned from it\); raise it, or use estimator reinforce"),
    ("trainer.advantage.estimator=dr_grpo sampling.group_size=1", "estimator dr_grpo compares"),
    ("process_group.process_id=1", "process_group: set, but distributed is false"),
    ("distributed=true process_group.join_timeout_s=0",
     "process_group.join_timeout_s: must be >= 1, got 0"),
    # the quickstart's batch: 8 prompts x 8 answers; the first step would fail
    ("trainer.ppo_n_minibatches=65", r"trainer.ppo_n_minibatches \(65\) is more than the 64 "),
    ("sft.trainer.lr=-1", r"sft.trainer.lr: must be > 0, got -1"),
    ("trainer.lr=0", r"trainer.lr: must be > 0, got 0"),
    ("sft.trainer.lrr=1", r"unknown config key sft.trainer.lrr"),
    # Accepted, these failed later without naming the setting: a seed outside the requests'
    # uint64 when the first group was submitted, after SFT and the first evaluation ...
    ("seed=-1", r"seed: must be in \[0, 2\*\*32\), got -1"),
    ("seed=18446744073709551615", r"seed: must be in \[0, 2\*\*32\)"),
    ("dataset.seed=-1", r"dataset.seed must be in \[0, 2\*\*32\), got -1"),
    ("trainer.seed=9223372036854775808", r"trainer: seed: must be in \[0, 2\*\*32\)"),
    # ... a temperature that arrives as float32 inf, refused by the servers in every request ...
    ("sampling.temperature=1e39", r"sampling.temperature: must be at most 3.4e\+38"),
    ("eval.temperature=1e39", r"eval.temperature: must be at most"),
    # ... SFT that ran 0 steps and exported the base model as the SFT model, or empty batches
    ("sft.steps=-1", r"sft.steps: must be >= 0 \(0: no SFT\), got -1"),
    ("sft.batch_size=0", r"sft.batch_size: must be >= 1, got 0"),
    ("sft.response_key=''", r"sft.response_key: must not be empty"),
])
def test_what_every_request_would_be_refused_for_is_refused_before_the_run(override, message):
    # Accepted, these made every eval request fail (accuracy NaN, written to the run's results)
    # or every rollout request be rejected; a negative checkpoint_every saved every step.
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, QUICKSTART, shlex.split(override))


def test_cli_reports_config_errors_without_traceback(capsys):
    from areal_jax.cli import main

    assert main(["train", "--config", str(QUICKSTART), "sampling.temperature=0.7",
                 "trainer.temperature=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-jax train: error: trainer.temperature (1) must equal")
    assert "Traceback" not in err


def test_a_full_or_read_only_disk_is_one_line_saying_how_to_go_on(capsys, monkeypatch, tmp_path):
    # It was a traceback, the ENOSPC at its end, often under a checkpoint or publishing error.
    from areal_jax import cli
    from areal_jax.controller import run

    def full_disk(cfg):
        try:
            raise OSError(28, "No space left on device", str(tmp_path / "exports" / "v000035"))
        except OSError as e:
            raise RuntimeError("publishing version 35 failed") from e

    monkeypatch.setattr(run, "train", full_disk)
    monkeypatch.setattr("areal_jax.commands._preflight.preflight", lambda cfg: None)
    assert cli.main(["train", "--config", str(QUICKSTART), f"run_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err == (f"areal-jax train: error: No space left on device: {tmp_path}/exports/v000035 "
                   "(free space, then run the same command again: it resumes from the last "
                   "checkpoint)\n")
    monkeypatch.setattr("areal_jax.commands.eval.run", lambda args: full_disk(None))
    assert cli.main(["eval", "--config", str(QUICKSTART), "--model", str(tmp_path)]) == 1
    assert capsys.readouterr().err.endswith("(free space, then run the command again)\n")

    def full_then_closed(cfg):
        # The ledger's close after the publisher's failure raises its own error, without a
        # file name: the message showed that one.
        try:
            full_disk(cfg)
        finally:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(run, "train", full_then_closed)
    assert cli.main(["train", "--config", str(QUICKSTART), f"run_dir={tmp_path}"]) == 1
    assert f"No space left on device: {tmp_path}/exports/v000035 (" in capsys.readouterr().err

    def read_only(cfg):  # a traceback ended in EROFS, the run dir's disk remounted read-only
        raise OSError(30, "Read-only file system", str(tmp_path / "exports" / ".v000046.tmp"))

    monkeypatch.setattr(run, "train", read_only)
    assert cli.main(["train", "--config", str(QUICKSTART), f"run_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err == (
        f"areal-jax train: error: Read-only file system: {tmp_path}/exports/.v000046.tmp (make "
        "it writable, then run the same command again: it resumes from the last checkpoint)\n")

    def unreadable_model(cfg):  # a setting's own error, a permission error behind it
        from areal_jax.config import ConfigError

        try:
            raise PermissionError(13, "Permission denied", "/models/qwen/config.json")
        except OSError as e:
            raise ConfigError("engine.model_path: cannot read /models/qwen/config.json") from e

    monkeypatch.setattr(run, "train", unreadable_model)
    assert cli.main(["train", "--config", str(QUICKSTART), f"run_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == ("areal-jax train: error: engine.model_path: cannot read "
                                       "/models/qwen/config.json\n")


@pytest.mark.parametrize("overrides,message", [
    (["trainer_memory_fraction=0.5", "rollout.server_memory_fraction=0.6"],
     r"trainer_memory_fraction \(0.5\) \+ rollout.server_memory_fraction \(0.6\) on every "
     r"device = 1.1 > 1"),
    (["trainer_memory_fraction=0.9", "rollout.server_memory_fraction=0.6", "trainer_devices=[0]",
      "rollout.num_local_servers=2", "rollout.server_devices=[[1], [0, 1]]"],
     r"^trainer_memory_fraction \(0.9\) \+ rollout.server_memory_fraction \(0.6\) on device 0 "
     r"= 1.5 > 1"),
    (["trainer_memory_fraction=0.2", "rollout.server_memory_fraction=0.6", "trainer_devices=[0]",
      "rollout.num_local_servers=2", "rollout.server_devices=[[1], [0, 1]]"],
     r"^rollout.server_memory_fraction \(0.6\) x 2 on device 1 = 1.2 > 1"),  # trainer not on 1
    (["trainer_memory_fraction=0.9"],  # the server takes its environment's share: JAX's 0.75
     r"trainer_memory_fraction \(0.9\) \+ rollout.server_memory_fraction \(unset: 0.75\) on "
     r"every device = 1.65 > 1"),
    (["trainer_memory_fraction=1.5"], r"trainer_memory_fraction: must be in \(0, 1\], got 1.5"),
])
def test_memory_fractions_of_processes_sharing_a_device_must_fit(overrides, message, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, QUICKSTART, overrides)


@pytest.mark.parametrize("config,overrides,environment", [
    ("quickstart", ["trainer_memory_fraction=0.4", "rollout.server_memory_fraction=0.6"], None),
    ("quickstart", ["trainer_memory_fraction=0.9", "rollout.server_memory_fraction=0.9",
                    "trainer_devices=[0]", "rollout.server_devices=[[1]]"], None),  # apart
    ("quickstart", ["trainer_memory_fraction=0.9"], "0.1"),  # the servers' environment: 0.1
    ("gsm8k_qwen2.5_0.5B_sglang", ["trainer_memory_fraction=0.9"], None),  # SGLang sizes itself
])
def test_memory_fractions_that_fit_are_accepted(config, overrides, environment, monkeypatch):
    if environment is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", environment)
    path = next(p for p in CONFIGS if p.stem == config)
    assert load_config(ExperimentConfig, path, overrides).rollout.num_local_servers == 1


@pytest.mark.parametrize("config,overrides,environment,with_trainer,expected", [
    ("quickstart", [], None, True, (0.55, 0.35)),  # one server on the trainer's devices
    ("quickstart", ["rollout.num_local_servers=2"], None, True, (0.55, 0.175)),
    ("quickstart", ["trainer_devices=[0]", "rollout.num_local_servers=2",
                    "rollout.server_devices=[[0], [1]]"], None, True, (0.55, 0.35)),
    ("quickstart", ["trainer_devices=[0]", "rollout.num_local_servers=2",
                    "rollout.server_devices=[[1], [1]]"], None, True, (None, 0.45)),  # no trainer
    ("quickstart", ["trainer_devices=[0]", "rollout.server_devices=[[1]]"], None, True,
     (None, None)),  # nothing shared
    ("quickstart", [], None, False, (None, None)),  # `eval`: one server, no trainer beside it
    ("quickstart", ["rollout.num_local_servers=2"], None, False, (None, 0.45)),
    ("quickstart", [], "0.3", True, (None, None)),  # the launching environment decides
    ("quickstart", ["trainer_memory_fraction=0.2"], None, True, (0.2, None)),  # one set: as is
    ("quickstart", ["rollout.server_memory_fraction=0.2"], None, True, (None, 0.2)),
    ("quickstart", ["rollout.addresses=[\"h:1\"]"], None, True, (None, None)),  # remote
    ("gsm8k_qwen2.5_0.5B_sglang", ["trainer_memory_fraction=null"], None, True, (None, None)),
])
def test_processes_sharing_a_device_get_shares_that_fit_when_none_is_set(
        config, overrides, environment, with_trainer, expected, monkeypatch):
    if environment is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", environment)
    path = next(p for p in CONFIGS if p.stem == config)
    cfg = load_config(ExperimentConfig, path, overrides)
    assert cfg.memory_fractions(with_trainer) == expected


def test_chosen_shares_stay_out_of_the_config(tmp_path, monkeypatch):
    """The run writes its config to config.json; reloaded with two servers it must choose
    again, not refuse shares the user never set."""
    from areal_jax.config import to_dict

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    cfg = load_config(ExperimentConfig, QUICKSTART)
    assert cfg.memory_fractions() == (0.55, 0.35)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(to_dict(cfg)))
    again = load_config(ExperimentConfig, saved, ["rollout.num_local_servers=2"])
    assert again.memory_fractions() == (0.55, 0.175)


def test_an_environment_share_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    with pytest.raises(ConfigError, match=(
            r"trainer_memory_fraction \(unset: XLA_PYTHON_CLIENT_MEM_FRACTION=0.9\) \+ "
            r"rollout.server_memory_fraction \(unset: XLA_PYTHON_CLIENT_MEM_FRACTION=0.9\) on "
            r"every device = 1.8 > 1")):
        load_config(ExperimentConfig, QUICKSTART)


def test_the_servers_compile_during_sft_needs_the_compilation_cache():
    with pytest.raises(ConfigError, match="compile_servers_during_sft: needs the persistent"):
        load_config(ExperimentConfig, QUICKSTART,
                    ["compile_servers_during_sft=true", "compilation_cache_dir=''"])


def test_the_trainers_memory_fraction_does_not_reach_its_servers(monkeypatch):
    from areal_jax.controller.run import claim_devices

    variable = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    cfg = load_config(ExperimentConfig, QUICKSTART,
                      ["trainer_memory_fraction=0.4", "rollout.server_memory_fraction=0.5"])
    for before in (None, "0.9"):
        if before is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, before)
        release = claim_devices(cfg)
        assert os.environ[variable] == "0.4"  # what the trainer's JAX reads when it starts
        release()
        assert os.environ.get(variable) == before  # what the servers it launches inherit


def test_deterministic_asks_xla_for_deterministic_ops_once_keeping_other_flags(monkeypatch):
    """For the trainer (and the compile helper, which inherits its environment), not for the
    rollout servers it starts."""
    from areal_jax.controller.run import claim_devices
    from areal_jax.controller.servers import server_env

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    default = load_config(ExperimentConfig, QUICKSTART)
    claim_devices(default)()  # () puts the share back
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"  # off by default
    assert server_env(default) is None
    cfg = load_config(ExperimentConfig, QUICKSTART, ["deterministic=true"])
    for _ in range(2):  # a second claim (e.g. a restarted phase) adds nothing
        claim_devices(cfg)()
        assert os.environ["XLA_FLAGS"] == (
            "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true")
        assert server_env(cfg) == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    monkeypatch.delenv("XLA_FLAGS")
    claim_devices(cfg)()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=true"


def test_chosen_shares_are_reported_on_an_accelerator_only(monkeypatch, capsys):
    import jax

    from areal_jax.controller.run import _report_default_memory_shares

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    cfg = load_config(ExperimentConfig, QUICKSTART)
    _report_default_memory_shares(cfg)
    assert capsys.readouterr().out == ""  # a CPU: the shares mean nothing
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _report_default_memory_shares(cfg)
    assert capsys.readouterr().out == (
        "processes share devices; memory shares: trainer 0.55, each local rollout server 0.35 "
        "(set them with trainer_memory_fraction and rollout.server_memory_fraction)\n")
    _report_default_memory_shares(load_config(ExperimentConfig, QUICKSTART,
                                              ["trainer_memory_fraction=0.2"]))
    assert capsys.readouterr().out == ""  # set by the user: nothing chosen


def test_yaml_that_does_not_parse_is_a_config_error_naming_where(tmp_path, capsys):
    from areal_jax.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: runs/x\ndataset: {path: a\n")
    with pytest.raises(ConfigError, match=r"config file .*bad.yaml: not valid YAML \(.* at line "
                                          r"3, column 1\)"):
        load_config(ExperimentConfig, bad)
    bad.write_bytes(b"run_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid UTF-8"):
        load_config(ExperimentConfig, bad)
    with pytest.raises(ConfigError, match=r"override sft.steps: its value '\[1' is not valid "
                                          r"YAML .*; quote a value holding spaces"):
        load_config(ExperimentConfig, QUICKSTART, ["sft.steps=[1"])
    for command in ("train", "eval", "serve", "export"):
        extra = {"eval": ["--model", str(tmp_path)], "export": ["--out", str(tmp_path / "o")]}
        assert main([command, "--config", str(bad), *extra.get(command, [])]) == 2, command
        err = capsys.readouterr().err
        assert "not valid UTF-8" in err and "Traceback" not in err, command


def test_the_shipped_server_config_loads_as_the_docs_start_it(tmp_path):
    from rollout.config import ServerConfig

    path = Path(__file__).parent.parent / "configs" / "server" / "jax.yaml"
    cfg = load_config(ServerConfig, path, [f"engine.model_path={tmp_path}", "port=50052"])
    assert (cfg.engine.kind, cfg.port, cfg.engine.model_path) == ("jax", 50052, str(tmp_path))
    assert cfg.engine.options == {"num_slots": 64, "max_seq_len": 2048, "precompile": True}
    sglang = load_config(ServerConfig, path, [f"engine.model_path={tmp_path}",
                                              "engine.kind=sglang", "engine.options={tp_size: 2}"])
    assert sglang.engine.options == {"tp_size": 2}
    with pytest.raises(ConfigError, match="engine.model_path: required"):
        load_config(ServerConfig, path)


def test_serve_names_the_model_path_that_is_not_there(tmp_path, capsys):
    from areal_jax.cli import main

    path = Path(__file__).parent.parent / "configs" / "server" / "jax.yaml"
    assert main(["serve", "--config", str(path), f"engine.model_path={tmp_path / 'nope'}",
                 "port=0"]) == 2
    err = capsys.readouterr().err
    assert f"engine.model_path: {tmp_path / 'nope'} is not a directory" in err


def test_the_package_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "areal_jax", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: areal-jax")
