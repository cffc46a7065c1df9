"""A rollout server as a real process: what it starts dies with it, and it follows its parent."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from _rollout_fakes import make_tokenizer_dir
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _procs import alive
from rollout.engines.sglang_launch import free_port

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, uses prctl")


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def server_setup(tmp_path):
    """A config running the SGLang double as the launched engine, with one reward worker."""
    model = tmp_path / "model"
    model.mkdir()
    dims = {"vocab_size": 50, "max_position_embeddings": 64}
    (model / "config.json").write_text(json.dumps(dims))
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text("from _rollout_sglang_double import main\nmain()\n")
    port = free_port()
    config = {
        "engine": {
            "kind": "sglang",
            "model_path": str(model),
            "tokenizer_path": str(make_tokenizer_dir(tmp_path / "tokenizer")),
            "options": {"python": sys.executable, "log_path": str(tmp_path / "sglang.log")},
        },
        "port": port,
        "push_dir": str(tmp_path / "push"),
        "rewards": {"num_workers": 1},
        "status_log_interval_s": 0,
    }
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, SGLANG_DOUBLE_STARTUP_S="0.1")
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(TESTS), str(REPO)])
    return path, port, env


def _wait_serving(port: int, pid: int, timeout_s: float = 120) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            assert alive(pid), "the server exited"
            assert time.monotonic() < deadline, "the server never served"
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)


def test_a_sigkilled_server_takes_sglang_and_reward_workers_with_it(server_setup):
    config, port, env = server_setup
    server = subprocess.Popen(
        [sys.executable, "-m", "rollout", "--config", str(config)], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_serving(port, server.pid)
        children = _children(server.pid)
        assert len(children) >= 2  # the SGLang process and the reward worker
        server.send_signal(signal.SIGKILL)
        server.wait()
        _wait(lambda: not any(alive(c) for c in children), 30, "a child outlived the server")
    finally:
        if server.poll() is None:
            server.kill()


def test_the_server_stops_when_its_parent_dies(server_setup):
    config, port, env = server_setup
    # A shell that starts the server with parent_pid = the shell's pid, prints its pid, waits.
    script = f'"{sys.executable}" -m rollout --config "{config}" parent_pid=$$ & echo $!; wait'
    parent = subprocess.Popen(
        ["sh", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    server_pid = int(parent.stdout.readline())
    try:
        _wait_serving(port, server_pid)
        children = _children(server_pid)
        assert children
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait(lambda: not alive(server_pid), 30, "the server outlived its parent")
        _wait(lambda: not any(alive(c) for c in children), 30, "a child outlived the server")
    finally:
        if alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
