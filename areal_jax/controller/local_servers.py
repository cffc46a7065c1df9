"""Launch rollout servers as local subprocesses (``python -m rollout``), optionally each pinned
to its own CPU cores, and stop them with the run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServers:
    """N rollout-server subprocesses sharing one server config (a plain dict)."""

    def __init__(self, server_config: dict, count: int, log_dir: str | Path,
                 cpu_sets: list[list[int]] | None = None, env: dict | None = None):
        if count < 1:
            raise ValueError(f"rollout.num_local_servers must be >= 1, got {count}")
        if cpu_sets is not None and len(cpu_sets) != count:
            raise ValueError(f"rollout.cpu_sets has {len(cpu_sets)} entries for {count} servers")
        self._config = server_config
        self._count = count
        self._log_dir = Path(log_dir)
        self._cpu_sets = cpu_sets
        self._env = env or {}
        self._procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        """Start every server; returns their addresses (readiness is checked by the client)."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self._count):
            port = free_port()
            cfg_path = self._log_dir / f"rollout_server_{i}.yaml"
            cfg_path.write_text(yaml.safe_dump({**self._config, "host": "127.0.0.1", "port": port}))
            env = {**os.environ, "GRPC_VERBOSITY": "ERROR", **self._env}
            cpus = self._cpu_sets[i] if self._cpu_sets else None
            log = open(self._log_dir / f"rollout_server_{i}.log", "ab")
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollout", "--config", str(cfg_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None,
            )
            log.close()
            self._procs.append(proc)
            self.addresses.append(f"127.0.0.1:{port}")
        return self.addresses

    def check_alive(self) -> None:
        """Raise with the log's tail if a server exited."""
        for i, proc in enumerate(self._procs):
            if proc.poll() is not None:
                tail = (self._log_dir / f"rollout_server_{i}.log").read_text()[-3000:]
                raise RuntimeError(
                    f"rollout server {i} exited with code {proc.returncode}; log tail:\n{tail}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every server (graceful shutdown), then SIGKILL stragglers."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> "LocalServers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
