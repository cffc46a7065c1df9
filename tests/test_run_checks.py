"""What `areal-jax train` checks before it starts a long run: the free-form server config, the
rewards, and that a run directory is not reused with other data or settings."""

import json
import os
import re

import pytest
import yaml

from areal_jax.cli import main
from areal_jax.config import ConfigError, from_dict, to_dict
from areal_jax.controller.prepare import check_fingerprint
from areal_jax.controller.sft_phase import sft_examples
from areal_jax.data import DatasetError
from areal_jax.experiment import ExperimentConfig


def _config(tmp_path, **changes):
    cfg = {
        "run_dir": str(tmp_path / "run"), "model_path": "tiny",
        "dataset": {"path": str(tmp_path / "train.jsonl"), "reward": "math",
                    "metadata_fields": {"answer": "answer"}},
    }
    for key, value in changes.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    return cfg


def _write(tmp_path, cfg):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_typo_in_rollout_server_fails_before_anything_starts(tmp_path, capsys):
    cfg = _config(tmp_path, rollout={"server": {"max_concurent_groups": 4}})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert "rollout.server: unknown config key max_concurent_groups" in err
    assert not (tmp_path / "run").exists()


def test_a_typo_in_the_engine_options_fails_before_anything_starts(tmp_path, capsys):
    # It surfaced only when the servers started, after SFT.
    for kind in ("jax", "sglang"):
        cfg = _config(tmp_path, sft={"steps": 3},
                      rollout={"server": {"engine": {"kind": kind, "options": {"max_seq_lenn": 1}}}})
        assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
        assert "unknown config key engine.options.max_seq_lenn" in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


def test_an_unimportable_reward_shows_the_import_error(tmp_path, capsys):
    cfg = _config(tmp_path, dataset={"reward": "no_such_package.rewards:score"})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert "dataset.reward" in err and "No module named 'no_such_package'" in err
    assert not (tmp_path / "run").exists()


def test_each_reward_error_names_the_setting_and_what_to_fix(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import functools\n\n"
        "def one_arg(completion):\n    return 1.0\n\n"
        "def good(completion, metadata):\n    return 1.0\n\n"
        "def three(completion, metadata, tol):\n    return 1.0\n\n"
        "@functools.wraps(three)\n"
        "def adapted(completion, metadata):\n    return three(completion, metadata, 0.1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [  # (changes, what the error must say)
        # the eval reward's own error was reported as dataset.reward's
        ({"dataset": {"reward": "my_rewards:good"},
          "eval": {"dataset": {"path": str(tmp_path / "train.jsonl"),
                               "reward": "my_rewards:nope"}}},
         "eval.dataset.reward: reward path 'my_rewards:nope'"),
        ({"rollout": {"server": {"rewards": {"custom": {"x": "my_rewards:nope"}}}}},
         "rollout.server.rewards.custom: custom reward 'x'"),
        # a wrong signature surfaced after SFT, the first evaluation and three RL batches
        ({"dataset": {"reward": "my_rewards:one_arg"}},
         "dataset.reward: reward path 'my_rewards:one_arg': "
         "one_arg(completion) cannot be called as a reward, fn(completion: str, metadata: dict)"),
        ({"dataset": {"reward": "not_next_to_you.rewards:score"}},
         "No module named 'not_next_to_you' (is its directory on PYTHONPATH?"),
        ({"dataset": {"reward": "good"}}, "or your own function as 'pkg.module:function'"),
    ]
    for changes, message in cases:
        cfg = _config(tmp_path, **changes)
        assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run").exists()
    # a wrapper is called with its own arguments, whatever the function it wraps takes
    from areal_jax.rewards.registry import import_path
    assert import_path("my_rewards:adapted")("x", {}) == 1.0


def test_a_reward_found_only_in_the_current_directory_is_refused_for_local_servers(
        tmp_path, capsys, monkeypatch):
    """``python -m areal_jax.cli`` puts the current directory on the import path; the local
    servers start without it. Such a reward passed the checks and the servers failed to import
    it after SFT."""
    from areal_jax.commands._preflight import preflight

    project = tmp_path / "project"
    (project / "here_rewards").mkdir(parents=True)
    (project / "here_rewards" / "__init__.py").write_text(
        "def score(completion, metadata):\n    return 1.0\n")
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))  # what python -m does
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cfg = _config(tmp_path, dataset={"reward": "here_rewards:score"}, sft={"steps": 3})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert ("dataset.reward: the local rollout servers cannot import 'here_rewards' (of "
            f"'here_rewards:score'), which this process finds in {project}: they start "
            "without the current directory") in err and f"PYTHONPATH={project}," in err
    assert not (tmp_path / "run").exists()
    listed = _config(tmp_path, rollout={"server": {"rewards": {"custom": {
        "mine": "here_rewards:score"}}}}, dataset={"reward": "mine"})
    with pytest.raises(ConfigError, match="rollout.server.rewards.custom.mine: the local "
                                          "rollout servers cannot import 'here_rewards'"):
        preflight(from_dict(ExperimentConfig, listed))
    # the servers get it through PYTHONPATH; remote servers are the user's to set up
    monkeypatch.setenv("PYTHONPATH", str(project))
    preflight(from_dict(ExperimentConfig, cfg))
    monkeypatch.delenv("PYTHONPATH")
    remote = {**cfg, "rollout": {"addresses": ["localhost:1"]}}
    preflight(from_dict(ExperimentConfig, remote))
    # A short name the remote servers define: this config must define it too, and says so.
    short = {**cfg, "dataset": {**cfg["dataset"], "reward": "mine"},
             "rollout": {"addresses": ["localhost:1"]}}
    with pytest.raises(ConfigError, match=r"dataset.reward: reward 'mine' is not registered; .*"
                                          r"\(with remote servers, list a short name in this "
                                          r"config's rollout.server.rewards.custom too"):
        preflight(from_dict(ExperimentConfig, short))


def test_a_model_path_without_a_hugging_face_config_names_the_setting(tmp_path, capsys):
    (tmp_path / "not_a_model").mkdir()
    cfg = _config(tmp_path, model_path=str(tmp_path / "not_a_model"))
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert f"model_path: {tmp_path / 'not_a_model'} has no config.json" in err
    # Weights and config without the tokenizer: named here, not as an empty tokenizer later.
    (tmp_path / "not_a_model" / "config.json").write_text("{}")
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert f"model_path: {tmp_path / 'not_a_model'} has no tokenizer vocabulary" in (
        capsys.readouterr().err)
    # tokenizer_config.json alone is no tokenizer: transformers built a 3-token one from it
    (tmp_path / "not_a_model" / "tokenizer_config.json").write_text("{}")
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert f"model_path: {tmp_path / 'not_a_model'} has no tokenizer vocabulary" in (
        capsys.readouterr().err)
    # eval checks its --model the same way, before starting any server; a run directory, one
    # of its checkpoints or a model's config.json given for a model is named as what it is.
    run = tmp_path / "a_run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "fingerprint.json").write_text("{}")
    # --samples that cannot be written: named before any server starts (it was a traceback
    # once the whole evaluation had run)
    assert main(["eval", "--config", _write(tmp_path, _config(tmp_path)), "--model",
                 str(tmp_path / "missing"), "--samples", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"areal-jax eval: error: --samples: {tmp_path} is a directory; name the file to write")
    (tmp_path / "old_run").mkdir()
    (tmp_path / "old_run" / "fingerprint.json").write_text("{}")
    assert main(["eval", "--config", _write(tmp_path, _config(tmp_path)), "--model",
                 str(tmp_path / "missing"), "--samples", str(tmp_path / "old_run" / "m")]) == 2
    assert "is inside the run directory" in capsys.readouterr().err
    for model, says in ((tmp_path / "missing", "does not exist"),
                        (tmp_path / "not_a_model", "has no tokenizer vocabulary"),
                        (tmp_path / "not_a_model" / "config.json", "is a file"),
                        (run, "is a run directory, not a model: name one of its exports"),
                        (run / "checkpoints" / "4", "is a training checkpoint, not a model: "
                                                    "`areal-jax export --config CONFIG "
                                                    "--version 4 --out DIR`")):
        assert main(["eval", "--config", _write(tmp_path, _config(tmp_path)), "--model",
                     str(model)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"areal-jax eval: error: --model: {model} {says}") and (
            "Traceback" not in err)


def test_weights_that_do_not_fit_the_models_config_are_named_before_the_run_dir_is_taken(
        tmp_path, capsys):
    # Found only as SFT loaded them, after the run directory had recorded the model: the same
    # run_dir then refused the corrected model as "another model".
    from areal_jax.models import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        max_position_embeddings=128, tokenizer_vocab_size=300))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    cfg = _config(tmp_path, model_path=str(model))
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert (f"model_path: checkpoint {model}: tensor model.layers.0.mlp.gate_proj.weight has "
            "shape (64, 32), the config implies (128, 32)") in capsys.readouterr().err
    (model / "model.safetensors").rename(tmp_path / "weights")
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert (f"model_path: no model.safetensors or model.safetensors.index.json in {model}"
            in capsys.readouterr().err)
    assert not (tmp_path / "run" / "fingerprint.json").exists()


def test_eval_needs_only_the_held_out_reward(tmp_path, capsys, monkeypatch):
    # The training reward, a module of the training machine, had to import for `eval` too.
    from areal_jax.controller import evaluation
    from areal_jax.models import TinyModelSpec, build_tiny_model

    seen = []

    async def evaluated(cfg, models, samples=None):
        seen.append(cfg.dataset.reward)
        return [{"eval/accuracy": 1.0, "eval/response_length": 3.0}]

    monkeypatch.setattr(evaluation, "evaluate_checkpoints", evaluated)
    held_out = {"dataset": {"path": str(tmp_path / "train.jsonl"), "reward": "math",
                            "metadata_fields": {"answer": "answer"}}}
    cfg = _config(tmp_path, dataset={"reward": "not_installed_here.rewards:score"},
                  eval=held_out)
    model = build_tiny_model(tmp_path / "model", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        max_position_embeddings=128, tokenizer_vocab_size=300))
    assert main(["eval", "--config", _write(tmp_path, cfg), "--model", str(model)]) == 0
    assert seen == ["math"] and '"eval/accuracy": 1.0' in capsys.readouterr().out
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2  # training still needs it
    assert "not_installed_here" in capsys.readouterr().err
    # A held-out reward that does not exist is named under its own setting (it was named as
    # dataset.reward, the setting `eval` copies it to)
    held_out["dataset"]["reward"] = "foo"
    assert main(["eval", "--config", _write(tmp_path, cfg), "--model", str(model)]) == 2
    assert capsys.readouterr().err.startswith(
        "areal-jax eval: error: eval.dataset.reward: reward 'foo' is not registered")


def test_an_unknown_reward_name_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path, dataset={"reward": "nmath"})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert "nmath" in capsys.readouterr().err


def test_changing_the_data_of_a_run_directory_is_detected(tmp_path):
    cfg = from_dict(ExperimentConfig, _config(tmp_path))
    (tmp_path / "run").mkdir()
    check_fingerprint(cfg)
    check_fingerprint(cfg)  # same data and config: fine
    (tmp_path / "train.jsonl").write_text('{"question": "1+2?", "answer": "3"}\n')
    with pytest.raises(ConfigError, match="another data configuration"):
        check_fingerprint(cfg)
    changed = from_dict(ExperimentConfig, _config(tmp_path, dataset={"reward": "code"}))
    with pytest.raises(ConfigError, match="data"):
        check_fingerprint(changed)
    # With the config the run started with recorded (train writes it), the refusal names
    # what changed: the setting, or the file whose contents changed.
    from areal_jax.config import to_dict

    (tmp_path / "run" / "config.json").write_text(json.dumps(to_dict(cfg)))
    with pytest.raises(ConfigError, match=r"another data configuration: dataset.reward was "
                                          r"'math', now 'code' \(see"):
        check_fingerprint(changed)
    (tmp_path / "train.jsonl").write_text('{"question": "1+2?", "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"another data configuration: the contents of "
                                          rf"{re.escape(str(tmp_path / 'train.jsonl'))} \(see"):
        check_fingerprint(cfg)
    # A longer run of the same experiment is not a change.
    longer = from_dict(ExperimentConfig, _config(tmp_path, schedule={"total_steps": 500}))
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    check_fingerprint(longer)


def test_a_run_directory_moved_or_named_another_way_is_the_same_run(tmp_path, monkeypatch):
    # The fingerprint hashed the data path with {run_dir} filled in: a moved run directory,
    # or the same one named by a relative path, was refused as "another data configuration".
    import shutil

    from areal_jax.controller.prepare import _filled_path_data_digest, run_fingerprint

    def at(run_dir):
        cfg = _config(tmp_path, run_dir=str(run_dir))
        cfg["dataset"]["path"] = "{run_dir}/train.jsonl"
        return from_dict(ExperimentConfig, cfg)

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    check_fingerprint(at(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    check_fingerprint(at(tmp_path / "b"))
    monkeypatch.chdir(tmp_path)
    check_fingerprint(at("a"))
    # A directory recorded the earlier way is still accepted, and recorded the new way.
    path = tmp_path / "a" / "fingerprint.json"
    path.write_text(json.dumps({**run_fingerprint(at(tmp_path / "a")),
                                "data": _filled_path_data_digest(at(tmp_path / "a"))}))
    check_fingerprint(at(tmp_path / "a"))
    assert json.loads(path.read_text()) == run_fingerprint(at(tmp_path / "a"))
    (tmp_path / "a" / "train.jsonl").write_text('{"question": "1+2?", "answer": "3"}\n')
    with pytest.raises(ConfigError, match="another data configuration"):
        check_fingerprint(at(tmp_path / "a"))


def test_a_model_replaced_at_its_path_is_detected(tmp_path):
    # The fingerprint hashed the model's path: another model put at that path resumed on the
    # old one's SFT model and checkpoints.
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(bytes(3 << 20))  # hashed at its two ends only
    cfg = from_dict(ExperimentConfig, _config(tmp_path, model_path=str(model)))
    (tmp_path / "run").mkdir()
    check_fingerprint(cfg)
    check_fingerprint(cfg)  # the same model: fine
    with (model / "model.safetensors").open("r+b") as f:  # another model's last weights
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(ConfigError, match="another model configuration"):
        check_fingerprint(cfg)
    (model / "model.safetensors").write_bytes(bytes(3 << 20))
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ConfigError, match="another model configuration"):
        check_fingerprint(cfg)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    check_fingerprint(cfg)
    # Entries named like weights that are not files are no weights: a FIFO hung the hashing,
    # a directory or a dangling link ended in a traceback.
    os.mkfifo(model / "extra.safetensors")
    (model / "old.safetensors").mkdir()
    (model / "backup.safetensors").symlink_to(tmp_path / "nonexistent")
    check_fingerprint(cfg)
    for name in ("extra.safetensors", "backup.safetensors"):
        (model / name).unlink()
    (model / "old.safetensors").rmdir()
    # The same model at another path is the same run.
    shutil.copytree(model, tmp_path / "copy")
    copy = _config(tmp_path, model_path=str(tmp_path / "copy"))
    check_fingerprint(from_dict(ExperimentConfig, copy))
    # A directory recorded the earlier way (the model's path) is still accepted, and recorded
    # the new way.
    from areal_jax.controller.prepare import _path_model_digest, run_fingerprint

    path = tmp_path / "run" / "fingerprint.json"
    path.write_text(json.dumps({**run_fingerprint(cfg), "model": _path_model_digest(cfg)}))
    check_fingerprint(cfg)
    assert json.loads(path.read_text()) == run_fingerprint(cfg)
    (model / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="another model configuration"):
        check_fingerprint(cfg)


def test_sft_and_a_refused_train_respect_the_run_directorys_fingerprint(tmp_path, capsys):
    # `sft` never checked it: `train` then reused an SFT model built with other settings. And a
    # refused `train` had already overwritten the run's config.json.
    cfg = _config(tmp_path, sft={"steps": 3, "response_key": "answer"})
    (tmp_path / "run").mkdir()
    check_fingerprint(from_dict(ExperimentConfig, cfg))
    (tmp_path / "run" / "config.json").write_text("as recorded")
    for command in ("sft", "train"):
        assert main([command, "--config", _write(tmp_path, cfg), "sft.steps=200"]) == 2
        assert "was started with another sft configuration" in capsys.readouterr().err
    assert not (tmp_path / "run" / "sft_model").exists()
    assert (tmp_path / "run" / "config.json").read_text() == "as recorded"


def test_a_train_refused_after_sft_names_the_setting_it_changed(tmp_path, capsys, monkeypatch):
    # `sft` left no config.json: a train with another reward in its run directory was refused
    # as "another data configuration", naming nothing.
    from areal_jax.controller import sft_phase

    monkeypatch.setattr(sft_phase, "run_sft", lambda cfg, *a, **k: tmp_path / "run" / "sft_model")
    cfg = _config(tmp_path, sft={"steps": 3, "response_key": "answer"})
    assert main(["sft", "--config", _write(tmp_path, cfg)]) == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["dataset"]["reward"] == "math"
    assert main(["train", "--config", _write(tmp_path, cfg), "dataset.reward=code"]) == 2
    assert ("another data configuration: dataset.reward was 'math', now 'code'"
            in capsys.readouterr().err)


def test_no_tiny_section_is_the_default_one_when_settings_are_compared(tmp_path):
    # Run directories recorded the tiny section's defaults before it became optional: every
    # resume printed "tiny was {...}, now None".
    from areal_jax.config import to_dict
    from areal_jax.controller.prepare import changed_since_last_start
    from areal_jax.models import TinyModelSpec

    cfg = from_dict(ExperimentConfig, _config(tmp_path))
    assert cfg.tiny is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(
        {**to_dict(cfg), "tiny": to_dict(TinyModelSpec())}))
    assert changed_since_last_start(cfg) == []
    wider = from_dict(ExperimentConfig, _config(tmp_path, tiny={"hidden_size": 256}))
    assert changed_since_last_start(wider) == ["tiny.hidden_size was 128, now 256"]


def test_temporary_files_of_a_killed_writer_are_removed_and_a_live_ones_kept(tmp_path):
    # A run SIGKILLed as it wrote results.json left .results.json.tmp-PID for good.
    import subprocess
    import sys

    from areal_jax.files import remove_unfinished_writes

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = tmp_path / f".results.json.tmp-{dead}"
    writing = tmp_path / f".metrics.jsonl.tmp-{os.getpid()}"  # a writer still running
    for path in (left, writing, tmp_path / "results.json"):
        path.write_text("{")
    assert remove_unfinished_writes(tmp_path) == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, "results.json"])


def test_files_a_run_trusts_later_are_written_whole_and_a_torn_one_is_named(tmp_path,
                                                                           monkeypatch):
    import os

    from areal_jax.files import write_atomic

    cfg = from_dict(ExperimentConfig, _config(tmp_path))
    (tmp_path / "run").mkdir()
    check_fingerprint(cfg)
    path = tmp_path / "run" / "fingerprint.json"
    whole = path.read_text()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "{")
    monkeypatch.undo()
    assert path.read_text() == whole and os.listdir(path.parent) == ["fingerprint.json"]
    path.write_text(whole[: len(whole) // 2])  # torn by a crash before files were written whole
    with pytest.raises(ConfigError, match=r"fingerprint.json is not valid JSON .* delete it"):
        check_fingerprint(cfg)
    path.write_text("[]")  # valid JSON of another shape failed with an AttributeError
    with pytest.raises(ConfigError, match=r"fingerprint.json holds a JSON list, not an object; "
                                          r"it was written by an earlier run"):
        check_fingerprint(cfg)
    path.write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError's traceback
    with pytest.raises(ConfigError, match=r"fingerprint.json is not valid JSON"):
        check_fingerprint(cfg)


def test_the_sft_command_refuses_a_distributed_config_or_a_config_it_cannot_use(tmp_path,
                                                                                capsys):
    # Every process would run its own SFT and write the same <run_dir>/sft_model.
    cfg = _config(tmp_path, sft={"steps": 2})
    assert main(["sft", "--config", _write(tmp_path, cfg), "distributed=true"]) == 2
    assert "areal-jax sft: error: distributed: `areal-jax sft` runs on one process" in (
        capsys.readouterr().err)
    assert main(["sft", "--config", _write(tmp_path, cfg), "sft.steps=0"]) == 2
    assert "areal-jax sft: error: sft.steps: must be >= 1" in capsys.readouterr().err
    # A config refused as its data is read leaves no run directory behind (it left one,
    # empty, where `train` leaves none).
    assert main(["sft", "--config", _write(tmp_path, cfg), "sft.response_key=solution"]) == 2
    assert "sft.response_key: 'solution' is not a key" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_sft_without_its_response_field_names_the_setting(tmp_path):
    from areal_jax.models.tiny import build_tiny_tokenizer

    cfg = from_dict(ExperimentConfig, _config(tmp_path, sft={"steps": 1}))
    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=300)
    with pytest.raises(ConfigError, match=r"sft.response_key: 'solution' is not a key of "
                                          r"dataset.metadata_fields \{'answer': 'answer'\}"):
        sft_examples(cfg, tok)


def test_a_server_context_the_model_or_the_answers_do_not_fit_fails_before_sft(tmp_path, capsys):
    # The servers would exit at their start (past the model's positions), or reject every
    # long request; both only after SFT had run.
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
            "num_kv_heads": 1, "max_position_embeddings": 256, "tokenizer_vocab_size": 300}
    key = "rollout.server.engine.options.max_seq_len"
    for options, sampling, message in (
            ({"max_seq_len": 512}, {}, f"{key}: 512 exceeds the model's "
                                       "max_position_embeddings 256"),
            # at the model's positions already: raising it is no remedy
            ({}, {"max_new_tokens": 250}, rf"{key} \(unset: 256, all the model holds\) is below "
                                          r"the longest training prompt \(\d+ tokens\) \+ "
                                          r"sampling.max_new_tokens \(250\) = \d+: the servers "
                                          r"would reject those requests; lower sampling"),
            ({"max_seq_len": 64}, {"max_new_tokens": 60}, rf"{key} \(64\) is below"),
            # The held-out prompts with their own answer length: every evaluation request
            # would be rejected, and the accuracy measured on none of them.
            ({"max_seq_len": 128}, {"max_new_tokens": 100},
             rf"{key} \(128\) is below the longest held-out prompt \(\d+ tokens\) \+ "
             r"eval.max_new_tokens \(126\)")):
        held_out = {"dataset": {"path": str(tmp_path / "train.jsonl"), "reward": "math",
                                "metadata_fields": {"answer": "answer"}},
                    "max_new_tokens": 126}
        cfg = _config(tmp_path, tiny=tiny, sampling=sampling, sft={"steps": 5}, eval=held_out,
                      rollout={"server": {"engine": {"options": options}}})
        assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), err
        assert not (tmp_path / "run" / "sft_model").exists()
    # eval checks the held-out prompts against the servers it would start the same way.
    assert main(["eval", "--config", _write(tmp_path, cfg), "--model",
                 str(tmp_path / "run" / "base_model")]) == 2
    assert re.search(message, capsys.readouterr().err)
    # A local SGLang: its context_length (or the model's positions) less the one token SGLang
    # keeps; a small KV pool may lower it further once it starts (make_pool).
    sglang = {"kind": "sglang", "options": {"context_length": 128}}
    cfg = _config(tmp_path, tiny=tiny, sampling={"max_new_tokens": 100}, sft={"steps": 5},
                  eval=held_out, rollout={"server": {"engine": sglang}})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert re.search(r"rollout.server.engine.options.context_length \(127\) is below the "
                     r"longest held-out prompt", capsys.readouterr().err)
    assert not (tmp_path / "run" / "sft_model").exists()


def test_an_evaluation_with_failed_requests_says_how_many_are_not_counted(capsys):
    from areal_jax.controller.rl_phase import _print_eval

    result = {"eval/accuracy": 0.5, "eval/num_prompts": 6.0, "eval/response_length": 12.0}
    _print_eval("after RL", {**result, "eval/failed": 0.0})
    assert capsys.readouterr().out == ("after RL: accuracy 0.500 on 6 held-out prompts (mean "
                                       "response 12.0 tokens)\n")
    _print_eval("after RL", {**result, "eval/failed": 2.0})
    assert "6 held-out prompts (mean response 12.0 tokens; 2 requests failed and are not " \
           "counted)" in capsys.readouterr().out


def test_a_recorded_accuracy_before_rl_is_compared_by_its_eval_settings(tmp_path, capsys):
    import asyncio

    from areal_jax.controller.rl_phase import _accuracy_before_rl, _eval_settings

    held_out = {"dataset": {"path": "t.jsonl", "reward": "math"}, "max_prompts": 16}
    cfg = from_dict(ExperimentConfig, _config(tmp_path, eval=held_out))
    (tmp_path / "run").mkdir()
    recorded = {"eval/accuracy": 0.5, "eval/num_prompts": 16.0, "eval/response_length": 9.0,
                "version": 0.0}
    path = tmp_path / "run" / "eval_before_rl.json"
    for settings, warned in ((None, False), (_eval_settings(cfg), False),
                             ({**_eval_settings(cfg), "max_prompts": 32}, True)):
        extra = {} if settings is None else {"settings": settings}  # None: an older record
        path.write_text(json.dumps({**recorded, **extra}))
        before = asyncio.run(_accuracy_before_rl(cfg, 3, None, None))
        assert before == recorded
        assert ("not comparable" in capsys.readouterr().out) is warned
    # A record without its numbers failed with a KeyError deep in the print.
    path.write_text(json.dumps({"version": 0.0, "eval/accuracy": "0.5"}))
    with pytest.raises(ConfigError, match=r"eval_before_rl.json has no number under "
                                          r"'eval/accuracy', 'eval/num_prompts', "
                                          r"'eval/response_length'; it was written"):
        asyncio.run(_accuracy_before_rl(cfg, 3, None, None))


def test_sft_refuses_a_null_empty_or_overlong_response_before_its_first_step(tmp_path):
    from areal_jax.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=300)
    cfg = from_dict(ExperimentConfig, _config(
        tmp_path, sft={"steps": 1}, trainer={"micro_batch": {"token_budget": 64}},
        dataset={"id_field": "id",
                 "metadata_fields": {"answer": "answer", "solution": "solution"}}))
    rows = [{"id": "a", "question": "1+1?", "answer": "2", "solution": "1+1=2"},
            {"id": "b", "question": "2+2?", "answer": "4", "solution": None}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"line 2: field 'solution': is null"):
        sft_examples(cfg, tok)
    rows[1]["solution"] = " "  # trained to answer with its end token alone, without a word
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"prompt b's 'solution' is empty"):
        sft_examples(cfg, tok)
    rows[1]["solution"] = "2+2=4 " * 40  # the 81st step of 200 in a real run, say
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"prompt b's prompt \(\d+ tokens\) \+ 'solution' "
                       r"\(\d+ tokens\) is over the SFT micro-batch token budget \(64"):
        sft_examples(cfg, tok)


def test_sft_targets_of_non_text_values_are_the_json_text_the_reward_reads(tmp_path):
    # The target was Python's str(): ['fig'] and True where the reward reads ["fig"] and true.
    from areal_jax.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=300)
    cfg = from_dict(ExperimentConfig, _config(
        tmp_path, sft={"steps": 1, "response_key": "answer"}, dataset={"id_field": "id"}))
    rows = [{"id": "a", "question": "1?", "answer": ["fig"]},
            {"id": "b", "question": "2?", "answer": True}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    targets = [tok.decode(response[:-1]) for _, response in sft_examples(cfg, tok)]
    assert targets == ['["fig"]', "true"]


def test_sft_ends_answers_with_a_token_generation_stops_on(tmp_path, caplog):
    """A tokenizer whose end token is not among the model's end ids (config.json,
    generation_config.json): SFT appended it, the servers never stopped on it, and every answer
    ran to max_new_tokens without a word."""
    from areal_jax.controller.sft_phase import sft_end_token
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model
    from areal_jax.models.tokenizer import load_tokenizer

    model = build_tiny_model(tmp_path / "m", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        tokenizer_vocab_size=300))
    config = json.loads((model / "config.json").read_text())
    tok = load_tokenizer(model, config["vocab_size"], "model_path")
    assert sft_end_token(model, tok) == tok.eos_token_id == config["eos_token_id"]
    other = config["pad_token_id"]
    assert other != tok.eos_token_id
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": other}))
    assert sft_end_token(model, tok) == other
    assert f"the tokenizer's end token {tok.eos_token!r} (id {tok.eos_token_id}) is not one " \
           f"the model stops on ([{other}]" in caplog.text
    # generation_config.json's end ids count as the servers' (transformers and SGLang stop on
    # them too)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [
        other, tok.eos_token_id]}))
    assert sft_end_token(model, tok) == tok.eos_token_id
    (model / "generation_config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    with pytest.raises(ConfigError, match="lists no end-of-sequence id"):
        sft_end_token(model, tok)


def test_a_run_refused_before_it_starts_leaves_no_run_directory(tmp_path, capsys):
    """With the user's own model and data, a config refused by the checks before SFT (here the
    answers do not fit the model's context) leaves no empty run directory, nor a log."""
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "m", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        max_position_embeddings=128, tokenizer_vocab_size=300))
    cfg = _config(tmp_path, model_path=str(model), sampling={"max_new_tokens": 200})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert "lower sampling.max_new_tokens" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_directory_in_use_by_another_process_is_refused_until_that_process_dies(
        tmp_path, capsys):
    """The same run started twice (a requeued job while its first attempt runs): the second
    resumed from the first one's checkpoint, pruned its exports and forced its own weights on
    the shared server. Now it is refused before it reads or writes the run."""
    import signal
    import subprocess
    import sys

    cfg = _config(tmp_path, sft={"steps": 3, "response_key": "answer"})
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from areal_jax.controller.run_lock import hold_run_dir\n"
        "with hold_run_dir(Path(sys.argv[1]), 'train'):\n"
        "    print('held', flush=True); time.sleep(120)\n"), str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in ("train", "sft"):
            assert main([command, "--config", _write(tmp_path, cfg)]) == 2
            err = capsys.readouterr().err
            assert f"run_dir {run} is in use by `areal-jax train` (pid {holder.pid} on " in err
            assert not (run / "config.json").exists() and not (run / "sft_model").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released the killed holder's lock: nothing stale to clean up
    from areal_jax.controller.run_lock import hold_run_dir

    with hold_run_dir(run, "sft"):
        assert "`areal-jax sft` (pid" in (run / ".lock").read_text()


def test_a_run_directory_that_cannot_be_locked_is_used_unguarded_with_a_warning(
        tmp_path, monkeypatch, caplog):
    """Lustre without flock, NFSv3 without lockd: flock fails with another error than
    'held'; the run must still start (it stopped with a traceback)."""
    import errno

    from areal_jax.controller import run_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with run_lock.hold_run_dir(tmp_path, "train"):
        pass
    assert "could not lock" in caplog.text and "No locks available" in caplog.text


def test_a_synthetic_task_no_dataset_reads_and_a_tiny_model_not_built_are_named(tmp_path,
                                                                                 caplog):
    """A quickstart config adapted to one's own data kept its synthetic section: the task was
    generated for nothing, without a word, and removing the section then changed the run's
    data; adapted to one's own model, its tiny section was ignored as silently."""
    from pathlib import Path

    from areal_jax.commands._preflight import warn_unused_sections
    from areal_jax.config import load_config

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    quickstart = str(next(p for p in configs if p.stem == "quickstart"))
    for path in configs:  # as shipped: every section used
        warn_unused_sections(load_config(ExperimentConfig, path, [f"run_dir={tmp_path}"]))
    own_model = load_config(ExperimentConfig, quickstart, [
        f"run_dir={tmp_path}", "model_path=/models/mine"])
    assert "no dataset reads it" not in caplog.text and "tiny:" not in caplog.text
    warn_unused_sections(own_model)  # the synthetic task is still the data
    assert "no dataset reads it" not in caplog.text
    assert ("tiny: describes the model built for model_path: tiny, but model_path is "
            "/models/mine: the section is ignored (remove it)") in caplog.text
    caplog.clear()
    warn_unused_sections(load_config(ExperimentConfig, quickstart, [
        f"run_dir={tmp_path}", "model_path=/models/mine", "tiny=null"]))
    assert "tiny:" not in caplog.text
    own_data = load_config(ExperimentConfig, quickstart, [
        f"run_dir={tmp_path}", "dataset.path=/data/train.jsonl",
        "eval.dataset.path=/data/test.jsonl"])
    warn_unused_sections(own_data)
    assert (f"synthetic: describes the arithmetic task it would write to {tmp_path}/data, but "
            "no dataset reads it (dataset.path: /data/train.jsonl): the section is ignored "
            "(remove it)") in caplog.text
    # Ignored: not written, and not part of the run's data, so removing it changes nothing.
    from areal_jax.controller.prepare import prepare_data

    cfg = from_dict(ExperimentConfig, _config(tmp_path, synthetic={"num_train": 5}))
    prepare_data(cfg)
    assert not (tmp_path / "run" / "data").exists()
    (tmp_path / "run").mkdir()
    check_fingerprint(cfg)
    without = from_dict(ExperimentConfig, {**to_dict(cfg), "synthetic": None})
    check_fingerprint(without)
    # A run directory whose record counted the unused section, removed before the next start.
    from areal_jax.controller import prepare

    (tmp_path / "run" / "fingerprint.json").write_text(json.dumps(
        {**prepare.run_fingerprint(cfg), "data": prepare._unused_synthetic_data_digest(cfg)}))
    prepare.record_config(cfg)
    check_fingerprint(without)
    with pytest.raises(ConfigError, match="another data configuration"):  # the data changed
        (tmp_path / "train.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n')
        check_fingerprint(without)


def test_sft_trainer_settings_are_checked_with_no_sft_steps(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key sft.trainer.lrr"):
        from_dict(ExperimentConfig, _config(tmp_path, sft={"steps": 0, "trainer": {"lrr": 1}}))


def test_a_config_refused_by_its_data_leaves_the_run_directory_free(tmp_path, capsys):
    # The fingerprint was recorded before the data was checked: once the field was corrected,
    # the run directory refused the corrected config as "another data configuration".
    cfg = _config(tmp_path, dataset={"prompt_field": "problem"}, schedule={"total_steps": 0})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert "problem" in capsys.readouterr().err
    assert not (tmp_path / "run" / "fingerprint.json").exists()
    assert not (tmp_path / "run" / "config.json").exists()


def test_sft_alone_on_a_new_run_directory_with_a_model_of_ones_own(tmp_path):
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "mine", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        tokenizer_vocab_size=300))
    cfg = _config(tmp_path, model_path=str(model), sft={"steps": 1, "response_key": "answer"},
                  run_dir=str(tmp_path / "new" / "run"))
    assert main(["sft", "--config", _write(tmp_path, cfg)]) == 0
    assert (tmp_path / "new" / "run" / "sft_model" / "config.json").is_file()


def test_a_run_keeps_its_id_for_the_servers_and_a_bad_one_is_named(tmp_path):
    from areal_jax.controller.prepare import run_id

    cfg = from_dict(ExperimentConfig, _config(tmp_path))
    (tmp_path / "run").mkdir()
    first = run_id(cfg)
    assert first.startswith("run-") and run_id(cfg) == first  # a resumed trainer: the same run
    (tmp_path / "run" / "run_id").write_text("прогон\n")  # not ASCII: no gRPC metadata value
    with pytest.raises(ConfigError, match="run_id: not a run id .* delete it"):
        run_id(cfg)


def test_an_unset_token_variable_is_named_before_anything_starts(tmp_path, capsys, monkeypatch):
    # The trainer connected without a token and the servers' UNAUTHENTICATED read as a wrong one.
    monkeypatch.delenv("AREAL_TEST_UNSET_TOKEN", raising=False)
    cfg = _config(tmp_path, rollout={"auth_token_env": "AREAL_TEST_UNSET_TOKEN"})
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    assert ("rollout.auth_token_env: AREAL_TEST_UNSET_TOKEN is unset (or empty) in this "
            "process's environment") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_samples_show_the_answer_with_its_end_token_and_as_the_reward_read_it(tmp_path):
    # The samples kept special tokens only: a reward's input could not be read from them.
    from areal_jax.controller.evaluation import answer_record, with_text
    from areal_jax.data.dataset import PromptItem
    from areal_jax.models.tiny import build_tiny_tokenizer
    from areal_jax.protocol.v1 import rollout_pb2 as pb

    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=300)
    ids = [*tok("7", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    item = PromptItem(id="a", prompt_ids=[1], prompt_text="3+4=", metadata={"answer": 7})
    [record] = with_text([answer_record(item, pb.Trajectory(
        output_ids=ids, reward=1.0, finish_reason=pb.FINISH_REASON_STOP))], tok)
    assert (record["completion"], record["reward_input"]) == ("7" + tok.eos_token, "7")
    assert record["metadata"] == {"answer": "7"}  # as the reward reads it


def test_a_synthetic_task_or_tiny_model_made_by_a_refused_start_is_named_when_the_config_changes(
        tmp_path, capsys):
    """A refused start had written the synthetic task and built the tiny model; the same
    run_dir with the synthetic or tiny section corrected kept them, and the run would have
    trained on data (and a model) of the refused config under the new one's fingerprint."""
    import shutil

    run = tmp_path / "run"

    def start(refusal="sampling.max_new_tokens (5000)", **changes):
        cfg = {"run_dir": str(run), "model_path": "tiny",
               "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                        "num_heads": 2, "num_kv_heads": 1, "tokenizer_vocab_size": 300},
               "synthetic": {"num_train": 40, "num_test": 10},
               "dataset": {"path": "{run_dir}/data/train.jsonl", "reward": "synthetic_arith",
                           "metadata_fields": {"answer": "answer"}},
               "sampling": {"max_new_tokens": 5000}}  # refused: fits no micro-batch
        for key, value in changes.items():
            cfg[key] = {**cfg[key], **value}
        assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
        assert refusal in capsys.readouterr().err
        return from_dict(ExperimentConfig, {**cfg, "sampling": {}})

    def made() -> tuple[int, int, int]:
        hidden = json.loads((run / "base_model" / "config.json").read_text())["hidden_size"]
        return (len((run / "data" / "train.jsonl").read_text().splitlines()),
                len((run / "data" / "test.jsonl").read_text().splitlines()), hidden)

    start()
    assert made() == (40, 10, 32)
    record = run / "made_from.json"
    whole = record.read_text()
    record.write_text(json.dumps({**json.loads(whole), "synthetic": [1]}))  # an AttributeError
    start(f"{record} is damaged (its synthetic section holds a JSON list, not an object): "
          f"delete {run / 'data'} and {record} to make it again")
    record.write_text(whole)
    start(f"{run / 'data'} was made from another synthetic section (synthetic.num_test was 10, "
          f"now 5; synthetic.num_train was 40, now 20) by an earlier command that trained "
          f"nothing on it (a start refused before it began, an evaluation): delete "
          f"{run / 'data'} to make it from this one",
          synthetic={"num_train": 20, "num_test": 5})
    shutil.rmtree(run / "data")
    start(f"{run / 'base_model'} was made from another tiny section (tiny.hidden_size was 32, "
          "now 64)", synthetic={"num_train": 20, "num_test": 5}, tiny={"hidden_size": 64})
    assert made() == (20, 5, 32)  # written anew; the model left as it was
    shutil.rmtree(run / "base_model")
    cfg = start(synthetic={"num_train": 20, "num_test": 5}, tiny={"hidden_size": 64})
    assert made() == (20, 5, 64)
    check_fingerprint(cfg)  # a start that began: its files are the run's from now on
    start(synthetic={"num_train": 30, "num_test": 5}, tiny={"hidden_size": 64})
    assert made() == (20, 5, 64)
    with pytest.raises(ConfigError, match="was started with another data configuration"):
        check_fingerprint(from_dict(ExperimentConfig, {**to_dict(cfg), "synthetic": {
            "num_train": 30, "num_test": 5}}))


def test_a_reward_failing_on_the_data_is_refused_before_sft(tmp_path, capsys, monkeypatch,
                                                             caplog):
    # A reward reading a metadata key the data does not give (metadata_fields mapped the other
    # way round) failed only in the evaluation after SFT; the corrected config was then refused
    # in that run directory, its data settings fixed: SFT had to run again.
    (tmp_path / "gold_rewards.py").write_text(
        "def needs_gold(completion, metadata):\n"
        "    return float(metadata['gold'] in completion)\n\n"
        "def slow(completion, metadata):\n    import time\n    time.sleep(60)\n\n"
        "def odd_rows(completion, metadata):\n"
        "    if metadata['answer'] == '3':\n        raise ValueError('three')\n"
        "    return float(metadata['answer'] in completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr("areal_jax.controller.run.run_sft", _not_started)
    monkeypatch.setattr("areal_jax.controller.sft_phase.run_sft", _not_started)  # `sft`'s
    rows = [{"id": f"r{i}", "question": f"1+{i}?", "answer": str(1 + i),
             "solution": f"1+{i}={1 + i}"} for i in range(6)]
    data = {"id_field": "id", "metadata_fields": {"answer": "answer", "solution": "solution"}}
    cfg = _config(tmp_path, sft={"steps": 1000}, dataset={**data, "reward": "gold_rewards:needs_gold"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err
    assert ("dataset.reward: 'gold_rewards:needs_gold' failed on every one of the first 4 "
            "training rows, called as the rollout servers call it on training rows r0, r1, r2, "
            "r3 (each row's metadata, its 'solution' as the answer); the first error: reward "
            "gold_rewards:needs_gold failed: KeyError: 'gold'") in err
    assert not (tmp_path / "run" / "fingerprint.json").exists()  # corrected in place, next
    # `areal-jax sft` alone checks it too: a later train keeps its SFT model, unchecked.
    assert main(["sft", "--config", _write(tmp_path, cfg)]) == 2
    assert "'gold_rewards:needs_gold' failed on every one" in capsys.readouterr().err
    assert not (tmp_path / "run" / "fingerprint.json").exists()
    # One failing on some rows is said, and SFT goes on (stopped here: it is what comes next).
    cfg = _config(tmp_path, sft={"steps": 1000}, dataset={**data, "reward": "gold_rewards:odd_rows"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(AssertionError, match="started"):
        main(["train", "--config", _write(tmp_path, cfg)])
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "failed on 1 of the first 4 training rows" in said[0]
    assert said[0].endswith("row r2: reward gold_rewards:odd_rows failed: ValueError: three")
    # Timeouts may be this machine's, not the reward's: said, not refused.
    caplog.clear()
    cfg = _config(tmp_path, sft={"steps": 1000}, dataset={**data, "reward": "gold_rewards:slow"},
                  rollout={"server": {"rewards": {"timeout_s": 1}}},
                  run_dir=str(tmp_path / "slow"))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(AssertionError, match="started"):
        main(["train", "--config", _write(tmp_path, cfg)])
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "failed on 4 of the first 4 training rows" in said[0]
    assert "reward gold_rewards:slow timed out after 1.0s" in said[0]


def _not_started(*args, **kwargs):
    raise AssertionError("started")


def test_export_compares_the_runs_model_while_its_files_are_there_and_its_sft_settings(
        tmp_path):
    import shutil

    from areal_jax.controller.prepare import check_checkpoints_model, record_config
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model

    spec = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                max_position_embeddings=128, tokenizer_vocab_size=300)
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(**spec))
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(**{**spec, "hidden_size": 16}))
    cfg = from_dict(ExperimentConfig, _config(tmp_path, model_path=str(model)))
    (tmp_path / "run").mkdir()
    check_fingerprint(cfg)
    record_config(cfg)
    check_checkpoints_model(cfg)  # the run's own config
    with pytest.raises(ConfigError, match=r"was trained with another model configuration: "
                       r"model_path was .*/m', now .*/other'.* Give the run's own: --config "):
        check_checkpoints_model(from_dict(ExperimentConfig, _config(
            tmp_path, model_path=str(other))))
    # The base model deleted since (an SFT run exports from its sft_model): a traceback before.
    shutil.rmtree(model)
    check_checkpoints_model(cfg)
    with pytest.raises(ConfigError, match="another sft configuration: sft.steps was 0, now 5"):
        check_checkpoints_model(from_dict(ExperimentConfig, _config(
            tmp_path, model_path=str(model), sft={"steps": 5})))
