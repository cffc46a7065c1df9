"""`areal-jax train distributed=true` as two processes x 4 CPU devices: one controller (process
0) with a local rollout server over gRPC, an SFT warm start and three RL versions trained by
both processes as one 8-device trainer, a checkpoint written across processes, and both
processes exiting together. (Parameter equality with a single-process run of the same batches
is checked in tests/test_multihost.py.)"""

import json
import os
import subprocess
import sys

from _e2e_kit import tiny_experiment, write_experiment

from areal_jax.controller.local_servers import free_port


def test_two_trainer_processes_train_through_a_local_rollout_server(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_experiment(tmp_path, total_steps=3)
    cfg["sft"]["steps"] = 2
    cfg["checkpoint_every"] = 3
    cfg["distributed"] = True
    cfg["compile_first_batches"] = True  # both processes compile the sketches ("sketches")
    path = write_experiment(tmp_path / "exp.yaml", cfg)
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = []
    for i in range(2):
        log = open(tmp_path / f"process{i}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "areal_jax.cli", "train", "--config", str(path),
             f"process_group.coordinator_address=127.0.0.1:{port}",
             "process_group.num_processes=2", f"process_group.process_id={i}"],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    assert codes == [0, 0], logs
    assert "after RL" in logs[0] and "after RL" not in logs[1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert (run_dir / "sft_model" / "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    assert (run_dir / "exports" / "v000003" / "config.json").is_file()
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "train"] == [1, 2, 3]
