"""Local rollout servers launched by the trainer: each gets its own accelerators and memory
share, and none outlives a trainer that is SIGKILLed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """
import json, sys, time
from areal_jax.controller.local_servers import LocalServers
servers = LocalServers({"engine": {"model_path": sys.argv[1]}}, 2, sys.argv[2],
                       devices=[[0], [1, 2]], memory_fraction=0.3)
servers.start()
print(json.dumps(servers.pids), flush=True)
time.sleep(600)
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in "ZX"


def test_local_servers_get_their_devices_and_die_with_a_killed_trainer(tmp_path):
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        max_position_embeddings=128, tokenizer_vocab_size=300))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model), str(tmp_path / "logs")],
                                stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(launcher.stdout.readline())
        envs = [_environ(pid) for pid in pids]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1,2"]
        assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == ["0", "1,2"]
        assert all(e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3" for e in envs)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 60
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, "a rollout server outlived its trainer"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in locals().get("pids", []):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
