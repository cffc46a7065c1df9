"""`areal-jax train` end to end on a tiny model: SFT warm start, a local rollout server over
gRPC, asynchronous RL, evaluation, checkpoints; then the same command resumes, and
`areal-jax export` writes a loadable HF directory."""

import json
import re
import shutil
from pathlib import Path

import grpc
import numpy as np
import yaml
from _e2e_kit import tiny_experiment, write_experiment
from _loop_kit import assert_nothing_lost
from _trainer_kit import truncate_checkpoint

from areal_jax.cli import main
from areal_jax.protocol.v1 import rollout_pb2, rollout_pb2_grpc
from areal_jax.config import from_dict


def _config(tmp_path, total_steps, **eval_settings):
    cfg = tiny_experiment(tmp_path, total_steps)
    cfg["trainer"]["export_keep_every"] = 2  # versions 0, 2, 4 outlive the pruning
    cfg["compile_servers_during_sft"] = True  # the server's programs compile beside SFT
    cfg["eval"].update(eval_settings)
    return write_experiment(tmp_path / "exp.yaml", cfg)


def _evaluations(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "eval/accuracy" in r]


def _command_line(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def _steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def _not_started(*args, **kwargs):
    raise AssertionError("the RL phase started")


def test_train_resume_and_export(tmp_path, capsys, monkeypatch):
    cfg = _config(tmp_path, total_steps=3)
    assert main(["train", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "run"
    assert "before RL" in out and "after RL" in out
    assert "rollout servers' programs compiled during SFT" in out
    compile_log = (run_dir / "logs" / "server_compile.log").read_text()
    assert "compiled the JAX engine's programs" in compile_log
    results = json.loads((run_dir / "results.json").read_text())
    assert 0.0 <= results["after"]["eval/accuracy"] <= 1.0
    assert results["after"]["eval/num_prompts"] == 8
    assert _steps(run_dir) == [1, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert all(r["staleness/max"] <= 1 for r in trained)
    assert all(r["reward/mean"] is not None for r in trained)
    assert (run_dir / "sft_model" / "model.safetensors").is_file()
    run_log = (run_dir / "logs" / "train.log").read_text()  # the run's own INFO messages
    assert "training prompts: 64" in run_log and "compiled ('train', (8, 128)) ahead" in run_log

    # What a writer SIGKILLed mid-write left (a temporary file, an export moved aside) goes at
    # the next start.
    killed = 2**22 + 1  # above the default pid_max: no process has it
    left = [run_dir / f".results.json.tmp-{killed}",
            run_dir / "eval_samples" / f".v3.jsonl.tmp-{killed}"]
    for path in left:
        path.write_text("{")
    (run_dir / "exports" / f".v000002.old-{killed}").mkdir()
    left.append(run_dir / "exports" / f".v000002.old-{killed}")

    # The same command with a larger budget resumes at version 3 and trains 2 more versions
    # (evaluating every 5: the loop's evaluation of version 5 is the one after RL, not a
    # second one).
    cfg = _config(tmp_path, total_steps=5, every_steps=5)
    assert main(["train", "--config", str(cfg)]) == 0
    assert not any(path.exists() for path in left)
    out = capsys.readouterr().out
    assert "resumed from checkpoint at version 3" in out
    assert f"settings changed since {run_dir} last started: " in out  # said, not refused
    assert "schedule.total_steps was 3, now 5" in out
    assert "compiled during SFT" not in out  # the SFT model was kept: no SFT to compile beside
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    # The accuracy before RL is the one measured before RL, not the resumed version's.
    resumed = json.loads((run_dir / "results.json").read_text())
    assert resumed["before"] == results["before"]
    assert _evaluations(run_dir) == [0, 3, 5]
    # The finished run run again, with other eval settings: evaluated, not logged twice, and
    # the recorded accuracy before RL is said not to be comparable.
    assert main(["train", "--config", str(_config(tmp_path, total_steps=5, max_prompts=4))]) == 0
    out = capsys.readouterr().out
    assert "measured with other eval settings" in out and "on 4 held-out prompts" in out
    assert _evaluations(run_dir) == [0, 3, 5]
    # Run again as it was: what it recorded is said, and nothing is started to measure it.
    recorded = (run_dir / "results.json").read_text()
    assert json.loads(recorded)["version"] == 5
    monkeypatch.setattr("areal_jax.controller.run.run_rl", _not_started)
    assert main(["train", "--config", str(_config(tmp_path, total_steps=5, max_prompts=4))]) == 0
    out = capsys.readouterr().out
    assert "already reached version 5 (schedule.total_steps: 5): nothing to train" in out
    assert "at version 5 (after RL, recorded): accuracy" in out and "on 4 held-out" in out
    assert "RL changed held-out accuracy" in out
    assert (run_dir / "results.json").read_text() == recorded
    monkeypatch.undo()
    cfg = _config(tmp_path, total_steps=5)
    # Across both runs, every prompt the data gave is trained exactly once or still pending.
    from areal_jax.data.config import DatasetConfig
    from areal_jax.data.dataset import PromptDataset
    from transformers import AutoTokenizer

    data = yaml.safe_load(cfg.read_text())["dataset"]
    data["path"] = str(run_dir / "data" / "train.jsonl")
    dataset = PromptDataset(from_dict(DatasetConfig, data),
                            AutoTokenizer.from_pretrained(run_dir / "base_model"))
    assert_nothing_lost(run_dir / "ledger.jsonl", dataset, dataset.config.seed,
                        dataset.config.shuffle)

    # Another model or SFT setting than the run's was exported without a word (the tokenizer
    # and generation settings of the model given; "no config.json in .../sft_model").
    assert main(["export", "--config", str(cfg), "--out", str(tmp_path / "other"),
                 "sft.steps=0"]) == 2
    assert (f"run_dir {run_dir} was trained with another sft configuration: sft.steps was "
            f"{yaml.safe_load(cfg.read_text())['sft']['steps']}, now 0") in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    assert main(["export", "--config", str(cfg), "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("Compute 1+2.")["input_ids"]
    logits = model(__import__("torch").tensor([ids])).logits.detach().numpy()
    assert np.isfinite(logits).all()
    # The published version 5 export and the checkpoint export hold the same weights.
    from areal_jax.models.safetensors_io import SafetensorsFile

    a = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    b = SafetensorsFile(run_dir / "exports" / "v000005" / "model.safetensors")
    for name in a.keys():
        np.testing.assert_array_equal(a.get(name), b.get(name).astype(a.dtype(name)))

    # The export evaluates through a fresh local server like any HF checkpoint.
    capsys.readouterr()
    assert main(["eval", "--config", str(cfg), "--model", str(tmp_path / "hf"), "--samples",
                 str(tmp_path / "answers.jsonl")]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["eval/num_prompts"] == 8 and evaluated["eval/failed"] == 0
    # What was answered and how it scored, to read when a reward surprises: the same answers
    # as the run's own last evaluation of that version (on its first 4 prompts).
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 8 and {a["model"] for a in answers} == {str(tmp_path / "hf")}
    assert np.mean([a["reward"] for a in answers]) == evaluated["eval/accuracy"]
    in_run = [json.loads(line) for line in
              (run_dir / "eval_samples" / "v5.jsonl").read_text().splitlines()]
    assert [(a["id"], a["completion"], a["reward"]) for a in answers[:4]] == [
        (a["id"], a["completion"], a["reward"]) for a in in_run]
    assert sorted(p.name for p in (run_dir / "eval_samples").iterdir()) == [
        "v0.jsonl", "v3.jsonl", "v5.jsonl"]
    assert all(a["finish_reason"] in ("stop", "length") and "answer" in a["metadata"]
               for a in answers)

    # The accuracy curve of the kept exports, measured after the run through one server.
    assert main(["eval", "--config", str(cfg), "--curve", str(run_dir)]) == 0
    curve = [json.loads(line) for line in (run_dir / "eval_curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [0, 2, 4, 5]  # multiples of 2, and the newest two
    assert all(r["eval/num_prompts"] == 8 and r["eval/failed"] == 0 for r in curve)
    # Greedy evaluation of the same weights gives the same accuracy, swapped in or not.
    assert curve[0]["eval/accuracy"] == results["before"]["eval/accuracy"]
    assert curve[-1]["eval/accuracy"] == evaluated["eval/accuracy"]

    assert main(["plot", str(run_dir), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000

    # An export never replaces the run, its models or anything but an earlier export; a
    # missing version lists those there are; a damaged newest checkpoint is an error, not a
    # silent export of an older one, and the run directory is left as it was.
    capsys.readouterr()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for out, message in ((run_dir, "is the run directory"),
                         (run_dir / "sft_model", "is the run's starting model"),
                         (tmp_path, "is the run directory .* or holds it"),
                         (run_dir / "logs", "holds '"),
                         (tmp_path / "hf2", r"--version 7: no such checkpoint .* there are "
                                            r"\d+, \d+, 5")):
        assert main(["export", "--config", str(cfg), "--out", str(out), "--version", "7"]) == 2
        assert re.search(message, capsys.readouterr().err), message
    truncate_checkpoint(run_dir / "checkpoints" / "5")
    assert main(["export", "--config", str(cfg), "--out", str(tmp_path / "hf3")]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "sft_model" / "model.safetensors").is_file()
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "hf3").exists()


def test_train_with_pushed_weights_keeps_staleness_bounded(tmp_path):
    """`weights_transport: push` streams every published version to the server over gRPC. If an
    update did not reach the server, its tokens would keep version 0 and the staleness of the
    third version would reach 2, above the bound of 1. (Without a held-out set, ``every_steps``
    evaluates nothing: an empty evaluation's row once stopped the run with a KeyError.)"""
    cfg = yaml.safe_load(_config(tmp_path, total_steps=3).read_text())
    cfg["rollout"]["weights_transport"] = "push"
    cfg["sft"]["steps"] = 0
    cfg["eval"] = {"every_steps": 1}
    path = tmp_path / "push.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in trained)


def test_sft_killed_before_its_model_was_written_runs_again(tmp_path):
    # SFT keeps no checkpoint: a re-run starts over at step 1, and its metrics must too (they
    # kept the killed run's steps and refused step 1 after step 2 of the earlier run).
    cfg = tiny_experiment(tmp_path, total_steps=0)
    path = write_experiment(tmp_path / "exp.yaml", cfg)
    assert main(["sft", "--config", str(path)]) == 0
    run_dir = tmp_path / "run"
    first = (run_dir / "sft_model" / "model.safetensors").read_bytes()
    shutil.rmtree(run_dir / "sft_model")  # as if killed after its last step
    assert main(["sft", "--config", str(path)]) == 0
    rows = (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]
    # The same config and seed on a CPU: the same weights, written whole.
    assert (run_dir / "sft_model" / "model.safetensors").read_bytes() == first
    assert not list(run_dir.glob("exports/v*"))  # written in place, not through an export


def test_sigterm_stops_a_run_like_ctrl_c(tmp_path):
    # SIGTERM (kill, scancel, docker stop) ended the trainer at once, without a word on how to
    # go on and without finishing its checkpoint writes. Started as a background job of a
    # script (`areal-jax train ... &`, an sbatch script), where SIGINT is ignored, a SIGTERM
    # turned into SIGINT was then dropped: the run went on to its end.
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = _config(tmp_path, total_steps=500)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 240
        while len(_steps(run_dir) if (run_dir / "metrics.jsonl").is_file() else []) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    # The versions trained since the last checkpoint were checkpointed as it stopped.
    last = _steps(run_dir)[-1]
    assert (run_dir / "checkpoints" / str(last)).is_dir(), err[-3000:]
    assert ("stopped; the same command resumes from the newest intact checkpoint in "
            f"{run_dir / 'checkpoints'} (the newest: version {last})") in err
    time.sleep(1)

    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path) in
            _command_line(pid)]
    assert not left  # its rollout server and helpers ended with it


def test_a_local_server_killed_during_the_evaluation_before_rl_is_restarted(tmp_path):
    # Local servers were restarted only inside the RL loop: one that died during the held-out
    # evaluation before (or after) RL was not, and the run waited out no_server_timeout_s and
    # failed.
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = tiny_experiment(tmp_path, total_steps=2)
    cfg["synthetic"]["num_test"] = 64
    cfg["eval"]["max_new_tokens"] = 48
    cfg["rollout"]["no_server_timeout_s"] = 30
    path = write_experiment(tmp_path / "exp.yaml", cfg)
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "rollout_server_0.log"
    proc = subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (log.is_file() and "rollout server on" in log.read_text(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        port = yaml.safe_load((log.parent / "rollout_server_0.yaml").read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus
            while not status(rollout_pb2.GetStatusRequest(), timeout=10).running_requests:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)  # until the evaluation's requests run
        server = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit()  # this run's:
                      and str(log.parent / "rollout_server_0.yaml") in _command_line(pid))
        os.kill(server, signal.SIGKILL)
        metrics = run_dir / "metrics.jsonl"
        assert not (metrics.is_file() and _evaluations(run_dir))  # killed before it ended
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "local rollout server 0 exited (killed by SIGKILL); restarted it" in err
    results = json.loads((run_dir / "results.json").read_text())
    assert results["before"]["eval/num_prompts"] == 64 and "after" in results
