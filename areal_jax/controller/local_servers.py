"""Launch rollout servers as local subprocesses (``python -m rollout``), each optionally pinned to
its own CPU cores and accelerators, and keep them tied to the run.

A server dies with the process that launched it: the kernel sends it SIGTERM when the launcher
dies (``PR_SET_PDEATHSIG``), and the server also watches its parent pid (``parent_pid`` in its
config), so a SIGKILLed trainer leaves no server holding accelerator memory. A server that
exits during the run can be restarted on its port (``restart_exited``), a bounded number of
times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from areal_jax.processes import own_module_argv, tied_argv


class ServerExitedError(RuntimeError):
    """A local rollout server exited (while starting, or too often during the run)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # a JAX process's share of a device
JAX_DEFAULT_MEMORY_FRACTION = 0.75  # JAX's share where the variable is unset


DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"  # XLA's deterministic GPU ops


def with_deterministic_ops(flags: str, on: bool) -> str:
    """The ``XLA_FLAGS`` value ``flags`` with XLA's deterministic GPU ops added (``on``), once,
    or removed; other flags kept in order."""
    kept = [flag for flag in flags.split() if flag != DETERMINISTIC_FLAG]
    return " ".join(kept + [DETERMINISTIC_FLAG] * on)


def device_env(devices: list[int] | None, memory_fraction: float | None) -> dict[str, str]:
    """Environment that gives a JAX process only ``devices`` (GPUs or TPU chips) and at most
    ``memory_fraction`` of each device's memory."""
    env = {}
    if devices is not None:
        ids = ",".join(str(d) for d in devices)
        env["CUDA_VISIBLE_DEVICES"] = ids
        env["TPU_VISIBLE_CHIPS"] = ids
    if memory_fraction is not None:
        env[MEMORY_FRACTION_VARIABLE] = f"{memory_fraction:g}"
    return env


RESTART_WINDOW_S = 3600.0  # restarts of a server counted against the limit: the last hour's


@dataclasses.dataclass
class _Proc:
    index: int
    port: int
    proc: subprocess.Popen | None = None
    restarts: list[float] = dataclasses.field(default_factory=list)  # when, the last hour's


def exit_text(returncode: int) -> str:
    """How a process ended, from its ``returncode``: ``exit code N`` or ``killed by SIGNAME``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class LocalServers:
    """N rollout-server subprocesses sharing one server config (a plain dict)."""

    def __init__(self, server_config: dict, count: int, log_dir: str | Path,
                 cpu_sets: list[list[int]] | None = None, env: dict | None = None,
                 devices: list[list[int]] | None = None, memory_fraction: float | None = None):
        if count < 1:
            raise ValueError(f"rollout.num_local_servers must be >= 1, got {count}")
        for name, sets in (("cpu_sets", cpu_sets), ("server_devices", devices)):
            if sets is not None and len(sets) != count:
                raise ValueError(f"rollout.{name} has {len(sets)} entries for {count} servers")
        self._config = server_config
        self._count = count
        self._log_dir = Path(log_dir)
        self._cpu_sets = cpu_sets
        self._devices = devices
        self._memory_fraction = memory_fraction
        self._env = env or {}
        self._procs: list[_Proc] = []
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        """Start every server; returns their addresses (readiness is checked by the client).
        If one cannot be started, those started before it are stopped and the error raised."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self._count):
                entry = _Proc(i, free_port())
                self._launch(entry)
                self._procs.append(entry)
                self.addresses.append(f"127.0.0.1:{entry.port}")
        except BaseException:
            self.stop()
            self.addresses.clear()
            raise
        return self.addresses

    def _launch(self, entry: _Proc, weights: tuple[int, Path] | None = None) -> None:
        cfg = {**self._config, "host": "127.0.0.1", "port": entry.port, "parent_pid": os.getpid()}
        if weights is not None:
            version, path = weights
            cfg["engine"] = {**cfg["engine"], "model_path": str(path), "initial_version": version}
        entry.proc = self._spawn(entry.index, cfg, f"rollout_server_{entry.index}")

    def _spawn(self, i: int, cfg: dict, name: str, *args: str) -> subprocess.Popen:
        """``python -m rollout`` on ``cfg`` (written to ``<log_dir>/<name>.yaml``) with server
        ``i``'s devices, memory share and CPUs, its output in ``<name>.log``, tied to us."""
        cfg_path = self._log_dir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        devices = self._devices[i] if self._devices else None
        argv = own_module_argv("rollout", ["--config", str(cfg_path), *args])
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR",
               **device_env(devices, self._memory_fraction), **self._env}
        cpus = self._cpu_sets[i] if self._cpu_sets else None
        with open(self._log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                tied_argv(argv, signal.SIGTERM, cpus),
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )

    def compile_programs(self) -> subprocess.Popen:
        """Start compiling the servers' JAX-engine programs into the persistent compilation
        cache, in a process of server 0's devices, memory share and CPUs that exits when done
        (``serve --compile-only``; output in ``<log_dir>/server_compile.log``). Servers started
        later with the same engine options and model shape read the programs from the cache;
        the weights play no part, so another checkpoint of the same shape will do."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._spawn(0, self._config, "server_compile", "--compile-only")

    @property
    def pids(self) -> list[int]:
        return [e.proc.pid for e in self._procs]

    def _log_tail(self, i: int) -> str:
        return (self._log_dir / f"rollout_server_{i}.log").read_text(errors="replace")[-3000:]

    def check_alive(self) -> None:
        """Raise ``ServerExitedError`` with the log's tail if a server exited."""
        for e in self._procs:
            if e.proc.poll() is not None:
                raise ServerExitedError(f"rollout server {e.index} exited with code "
                                   f"{e.proc.returncode}; log tail:\n{self._log_tail(e.index)}")

    def exited(self) -> list[int]:
        """Indices of the servers whose process has exited."""
        return [e.index for e in self._procs if e.proc.poll() is not None]

    def restart_exited(self, max_restarts: int,
                       weights: Mapping[int, tuple[int, Path] | None] | None = None
                       ) -> list[tuple[int, str]]:
        """Start again, on the same port, every server that exited (with ``weights``, those
        of them it names); returns their indices, each with how it ended (``exit_text``).

        ``weights[index]`` (version, checkpoint): what that server loads as it starts instead
        of the checkpoint it was launched with, which the run may have pruned since (None: that
        one). A server that exited after ``weights`` was made waits for the next call, not
        restarted on a checkpoint that may be gone. Raises
        ``ServerExitedError`` with the log's tail for a server that exited more than
        ``max_restarts`` times within ``RESTART_WINDOW_S``: it is failing, not flaking (rare
        crashes over a run of days are restarted each time).
        """
        restarted = []
        now = time.monotonic()
        for e in self._procs:
            if e.proc.poll() is None or (weights is not None and e.index not in weights):
                continue
            e.restarts = [t for t in e.restarts if now - t < RESTART_WINDOW_S]
            if len(e.restarts) >= max_restarts:
                raise ServerExitedError(
                    f"rollout server {e.index} exited {len(e.restarts) + 1} times within "
                    f"{RESTART_WINDOW_S / 60:g} minutes (last code {e.proc.returncode}); log "
                    f"tail:\n{self._log_tail(e.index)}")
            e.restarts.append(now)
            ended = exit_text(e.proc.returncode)
            self._launch(e, weights.get(e.index) if weights is not None else None)
            restarted.append((e.index, ended))
        return restarted

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every server (graceful shutdown), then SIGKILL stragglers. A stopped
        (SIGSTOP) server is continued, with its process group, so that it takes the SIGTERM at
        once."""
        for e in self._procs:
            if e.proc.poll() is None:
                e.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(e.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for e in self._procs:
            try:
                e.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(e.proc.pid, signal.SIGKILL)
                e.proc.wait()
        self._procs.clear()

    def __enter__(self) -> "LocalServers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
