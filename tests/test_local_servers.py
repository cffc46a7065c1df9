"""Local rollout servers launched by the trainer: each gets its own accelerators and memory
share, and none outlives a trainer that is SIGKILLed; the launcher that ties a command to its
parent without running Python between fork and exec."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _procs import alive

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
    """``pid``'s environment. While the process is in the middle of an exec (the launcher
    becoming the server) the kernel shows an empty one: read again until it is not."""
    deadline = time.monotonic() + 10
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        if env or time.monotonic() > deadline:
            return env
        time.sleep(0.05)


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
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "a rollout server outlived its trainer"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in locals().get("pids", []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


TIED_PARENT = r"""
import json, os, signal, subprocess, sys, threading, time
from areal_jax.processes import tied_argv
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()  # a multithreaded parent
cpu = min(os.sched_getaffinity(0))
child = subprocess.Popen(tied_argv([sys.executable, "-c", sys.argv[1]], signal.SIGTERM, [cpu]),
                         stdout=subprocess.PIPE, text=True)
print(json.dumps({"popen_pid": child.pid, "cpu": cpu,
                  "report": json.loads(child.stdout.readline())}), flush=True)
time.sleep(120)
"""
TIED_CHILD = r"""
import ctypes, json, os, time
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "signal": sig.value,
                  "cpus": sorted(os.sched_getaffinity(0))}), flush=True)
time.sleep(120)
"""


def test_a_tied_command_runs_pinned_in_the_launched_pid_and_dies_with_its_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", TIED_PARENT, TIED_CHILD],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = json.loads(parent.stdout.readline())
        child = line["report"]
        assert child["pid"] == line["popen_pid"]  # the launcher exec'd the command itself
        assert child["ppid"] == parent.pid
        assert child["signal"] == signal.SIGTERM
        assert child["cpus"] == [line["cpu"]]
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while alive(child["pid"]):
            assert time.monotonic() < deadline, "a tied command outlived its SIGKILLed parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
        child_pid = locals().get("child", {}).get("pid")
        if child_pid and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_the_launcher_refuses_a_gone_parent_and_names_what_it_cannot_run_or_pin():
    from areal_jax.processes import tied_argv

    argv = tied_argv(["/nonexistent/areal-command", "--flag"])
    missing = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127
    assert "/nonexistent/areal-command" in missing.stderr
    assert argv[argv.index("--parent") + 1] == str(os.getpid())
    # a parent that is not the launcher's (our own parent) stands for one that died before
    # the launcher armed the signal
    gone = subprocess.run([sys.executable, "-m", "areal_jax.processes", "--parent",
                           str(os.getppid()), "--", sys.executable, "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "ran" not in gone.stdout
    nowhere = (os.cpu_count() or 1) + 100
    unpinned = subprocess.run(tied_argv([sys.executable, "-c", "print('ran')"], cpus=[nowhere]),
                              capture_output=True, text=True, timeout=60)
    assert unpinned.returncode == 127 and "ran" not in unpinned.stdout
    assert f"on CPUs [{nowhere}]" in unpinned.stderr


def _cache_entries(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("*") if p.is_file() and "atime" not in p.name}


def test_programs_compiled_ahead_are_the_ones_another_checkpoint_of_the_same_shape_needs(
        tmp_path):
    from areal_jax.controller.local_servers import LocalServers
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model

    spec = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                max_position_embeddings=64, tokenizer_vocab_size=300)
    base = build_tiny_model(tmp_path / "base", TinyModelSpec(**spec, seed=0))
    tuned = build_tiny_model(tmp_path / "tuned", TinyModelSpec(**spec, seed=1))
    cache = tmp_path / "cache"
    options = {"num_slots": 2, "max_seq_len": 32, "decode_steps_per_call": 2}
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    entries = []
    for i, model in enumerate((base, tuned)):
        servers = LocalServers({"engine": {"model_path": str(model), "options": options}}, 1,
                               tmp_path / f"logs{i}", env=env)
        assert servers.compile_programs().wait(300) == 0
        log = (tmp_path / f"logs{i}" / "server_compile.log").read_text()
        assert "compiled the JAX engine's programs" in log
        entries.append(_cache_entries(cache))
    # prefill at 16 and 32 tokens, decode per window (16, 32) and batch (1, 2)
    assert len(entries[0]) >= 6
    assert entries[1] == entries[0]  # the second checkpoint compiled nothing new


def test_compile_only_names_what_it_cannot_do(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"engine": {"kind": "sglang", "model_path": str(tmp_path)}}))
    sglang = subprocess.run([sys.executable, "-m", "rollout", "--config", str(config),
                             "--compile-only"], capture_output=True, text=True, timeout=120)
    assert sglang.returncode == 2
    assert "engine.kind: --compile-only compiles the JAX engine's programs; got 'sglang'" in (
        sglang.stderr)
    config.write_text(yaml.safe_dump({"engine": {"model_path": str(tmp_path)}}))
    no_cache = subprocess.run([sys.executable, "-m", "rollout", "--config", str(config),
                               "--compile-only"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_COMPILATION_CACHE_DIR": ""})
    assert no_cache.returncode == 2
    assert "--compile-only needs the persistent compilation cache" in no_cache.stderr


@pytest.mark.parametrize("changes, sft_pending, expected", [
    ({}, True, False),  # the servers' compile would share the trainer's CPU: only move work
    ({"trainer_cpus": [0], "rollout": {"cpu_sets": [[1]]}}, True, True),
    ({"trainer_cpus": [0], "rollout": {"cpu_sets": [[1]]}}, False, False),  # no SFT to hide in
    ({"compile_servers_during_sft": True}, True, True),
    ({"compile_servers_during_sft": True, "rollout": {"addresses": ["host:50051"]}}, True,
     False),  # no local servers
    ({"compile_servers_during_sft": True,
      "rollout": {"server": {"engine": {"kind": "sglang"}}}}, True, False),
])
def test_servers_compile_during_sft_where_it_takes_no_cpu_from_it(tmp_path, changes,
                                                                 sft_pending, expected):
    from _e2e_kit import tiny_experiment

    from areal_jax.config import from_dict
    from areal_jax.controller.servers import compiles_servers_during_sft
    from areal_jax.experiment import ExperimentConfig

    raw = tiny_experiment(tmp_path, total_steps=1)
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    assert compiles_servers_during_sft(from_dict(ExperimentConfig, raw), sft_pending) is expected


def test_asking_for_the_servers_compile_with_the_cache_off_is_an_error(tmp_path):
    import jax
    from _e2e_kit import tiny_experiment

    from areal_jax.config import ConfigError, from_dict
    from areal_jax.controller.servers import compiles_servers_during_sft
    from areal_jax.experiment import ExperimentConfig

    raw = {**tiny_experiment(tmp_path, total_steps=1), "compile_servers_during_sft": True}
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with pytest.raises(ConfigError, match="compile_servers_during_sft: needs the persistent"):
            compiles_servers_during_sft(from_dict(ExperimentConfig, raw), True)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _fake_compile(code: str, started: list):
    """A stand-in for ``LocalServers.compile_programs``: runs ``code`` in its own session, like
    the real process, and appends the process to ``started``."""
    def start(self):
        started.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))
        return started[-1]
    return start


@pytest.fixture
def compile_cfg(tmp_path):
    from _e2e_kit import tiny_experiment

    from areal_jax.config import from_dict
    from areal_jax.experiment import ExperimentConfig

    raw = {**tiny_experiment(tmp_path, total_steps=1), "compile_servers_during_sft": True}
    return from_dict(ExperimentConfig, raw)


def test_the_servers_compile_reports_its_own_time_not_sfts(compile_cfg, tmp_path, monkeypatch,
                                                          capsys):
    from areal_jax.controller.local_servers import LocalServers
    from areal_jax.controller.servers import servers_compiling

    monkeypatch.setattr(LocalServers, "compile_programs", _fake_compile("pass", []))
    with servers_compiling(compile_cfg, tmp_path, sft_pending=True):
        time.sleep(3.0)  # SFT; the fake compile ends long before
    out = capsys.readouterr().out
    seconds = float(out.split("compiled during SFT in ")[1].split(" s")[0])
    assert seconds < 2.5 and "after SFT" not in out


@pytest.mark.parametrize("code, wait_s, message", [
    ("import sys; sys.exit(3)", 60, "failed (exit code 3, log: "),
    ("import time; time.sleep(60)", 0.5, "did not end within 0.5 s after SFT: stopped it"),
])
def test_a_servers_compile_that_fails_or_overruns_is_reported_and_leaves_nothing(
        compile_cfg, tmp_path, monkeypatch, capsys, code, wait_s, message):
    from areal_jax.controller import servers
    from areal_jax.controller.local_servers import LocalServers

    started = []
    monkeypatch.setattr(LocalServers, "compile_programs", _fake_compile(code, started))
    monkeypatch.setattr(servers, "SERVER_COMPILE_WAIT_S", wait_s)
    with servers.servers_compiling(compile_cfg, tmp_path, sft_pending=True):
        pass
    assert message in capsys.readouterr().out
    assert started[0].poll() is not None


def test_sft_failing_kills_the_servers_compile(compile_cfg, tmp_path, monkeypatch):
    from areal_jax.controller.local_servers import LocalServers
    from areal_jax.controller.servers import servers_compiling

    started = []
    monkeypatch.setattr(LocalServers, "compile_programs",
                        _fake_compile("import time; time.sleep(60)", started))
    with pytest.raises(RuntimeError, match="SFT failed"):
        with servers_compiling(compile_cfg, tmp_path, sft_pending=True):
            raise RuntimeError("SFT failed")
    assert started[0].poll() == -signal.SIGKILL


def test_an_exited_server_restarts_on_the_newest_export(tmp_path):
    # The checkpoint a server was launched with is pruned once newer versions are published:
    # restarted with it, the server exited again at once and the run ended after three tries.
    # And the newest export may be pruned in turn before the restarted server has read it (two
    # more versions published while it starts): it starts on a copy.
    import asyncio
    import shutil

    from areal_jax.controller.local_servers import LocalServers
    from areal_jax.controller.rollout_pool import RolloutPool
    from areal_jax.controller.servers import supervise_local
    from areal_jax.models.tiny import TinyModelSpec, build_tiny_model
    from areal_jax.trainer import export_path

    exports = tmp_path / "exports"
    build_tiny_model(export_path(exports, 7), TinyModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        max_position_embeddings=128, tokenizer_vocab_size=300))

    class PrunedAsItRestarts(LocalServers):
        def restart_exited(self, max_restarts, weights):
            restarted = super().restart_exited(max_restarts, weights)
            shutil.rmtree(export_path(exports, 7), ignore_errors=True)
            return restarted

    servers = PrunedAsItRestarts({"engine": {"model_path": str(export_path(exports, 0))}}, 1,
                                 tmp_path / "logs")

    async def main():
        (address,) = servers.start()
        watch = asyncio.create_task(supervise_local(servers, exports, interval_s=0.2))
        pool = RolloutPool([address])
        try:
            await pool.start(ready_timeout_s=120)
            return [s.version for s in (await pool.statuses()).values()]
        finally:
            watch.cancel()
            await pool.close()

    try:
        assert asyncio.run(main()) == [7]
        log = (tmp_path / "logs" / "rollout_server_0.log").read_text()
        assert "config error" in log and "(jax engine, version 7" in log  # exited, restarted
        assert log.count("config error") == 1  # the copy was there after the export was gone
    finally:
        servers.stop()
    assert not list(exports.glob(".restart-*"))  # the copies go with the supervision


def test_only_the_last_hours_restarts_count_against_the_limit(tmp_path, monkeypatch):
    # The count never went down: four crashes over a run of days ended it.
    from areal_jax.controller import local_servers
    from areal_jax.controller.local_servers import LocalServers, ServerExitedError

    class Exited:
        returncode = 1

        def poll(self):
            return 1

    class AlwaysExiting(LocalServers):
        def _launch(self, entry, weights=None):
            entry.proc = Exited()

    now = [0.0]
    monkeypatch.setattr(local_servers.time, "monotonic", lambda: now[0])
    servers = AlwaysExiting({"engine": {}}, 1, tmp_path / "logs")
    servers.start()
    for _ in range(6):  # one exit every 40 minutes: restarted each time
        now[0] += 2400
        assert servers.restart_exited(3) == [(0, "exit code 1")]
    assert servers.restart_exited(3, {}) == []  # exited after the weights were chosen: later
    now[0] += 60  # a third within the hour (the last two 40 minutes and 1 minute ago)
    assert servers.restart_exited(3) == [(0, "exit code 1")]
    (tmp_path / "logs" / "rollout_server_0.log").write_text("boom")
    now[0] += 60  # a fourth
    with pytest.raises(ServerExitedError, match="exited 4 times within 60 minutes"):
        servers.restart_exited(3)


def test_work_under_supervision_is_cut_short_by_a_server_that_keeps_exiting(tmp_path):
    import asyncio

    from areal_jax.controller.local_servers import ServerExitedError
    from areal_jax.controller.servers import MAX_LOCAL_RESTARTS, Supervision

    class KeepsExiting:  # what Supervision uses of LocalServers
        restarts = 0

        def exited(self):
            return [0]

        def restart_exited(self, max_restarts, weights):
            if self.restarts >= max_restarts:
                raise ServerExitedError(f"rollout server 0 exited {self.restarts + 1} times")
            self.restarts += 1
            return [(0, "exit code 1")]

    exports = tmp_path / "exports"
    (exports / "v000003").mkdir(parents=True)
    servers = KeepsExiting()

    async def main():
        cancelled = []

        async def work():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        async with Supervision(servers, exports, interval_s=0.01) as supervision:
            with pytest.raises(ServerExitedError, match="exited 4 times"):
                await supervision.run(work())
            with pytest.raises(ServerExitedError):  # and any work after it
                await supervision.run(asyncio.sleep(1))
        async with Supervision(None, exports) as without_servers:
            assert await without_servers.run(asyncio.sleep(0, "done")) == "done"
        return cancelled

    assert asyncio.run(main()) == [True]
    assert servers.restarts == MAX_LOCAL_RESTARTS
    assert not list(exports.glob(".restart-*"))


def test_a_server_that_keeps_exiting_after_the_last_work_is_reported(tmp_path, caplog):
    # With no held-out set nothing runs after the loop: the error was dropped without a word.
    import asyncio

    from areal_jax.controller.local_servers import ServerExitedError
    from areal_jax.controller.servers import Supervision

    class ExitsForGood:
        def exited(self):
            return [0]

        def restart_exited(self, max_restarts, weights):
            raise ServerExitedError("rollout server 0 exited 4 times within 60 minutes")

    exports = tmp_path / "exports"
    (exports / "v000003").mkdir(parents=True)

    async def main():
        async with Supervision(ExitsForGood(), exports, interval_s=0.01) as supervision:
            assert await supervision.run(asyncio.sleep(0, "done")) == "done"
            await asyncio.sleep(0.5)  # the server fails for good after the work

    with caplog.at_level("ERROR"):
        asyncio.run(main())
    assert "rollout server 0 exited 4 times" in caplog.text


def test_a_users_own_rollout_module_neither_runs_as_a_server_nor_hides_the_package(tmp_path):
    # A rollout.py next to the user's config: local servers, started in that directory with
    # `python -m rollout`, ran it instead (exit 0, "rollout server 0 exited"), and with
    # PYTHONPATH=$PWD the trainer died on `No module named 'rollout.config'`.
    from areal_jax.processes import own_module_argv

    (tmp_path / "rollout.py").write_text('print("a user\'s own rollout helper")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    served = subprocess.run(own_module_argv("rollout", ["--help"]), env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 0 and "Run a rollout server" in served.stdout
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    trained = subprocess.run(
        [sys.executable, "-m", "areal_jax.cli", "train", "--config", str(quickstart),
         f"run_dir={tmp_path / 'run'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert trained.returncode == 2
    assert f"hides areal-jax's package of the same name (rollout: {tmp_path / 'rollout.py'})" \
        in trained.stderr
    assert not (tmp_path / "run").exists()


def test_a_frozen_server_is_stopped_by_its_sigterm_not_waited_out(tmp_path):
    # A server frozen by SIGSTOP held its SIGTERM pending: stop() waited its whole timeout
    # (20 s, blocking the trainer's event loop) and then SIGKILLed it.
    import signal
    import subprocess
    import sys

    from areal_jax.controller.local_servers import LocalServers, _Proc

    servers = LocalServers({}, 1, tmp_path)
    graceful = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
                "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", graceful], stdout=subprocess.PIPE,
                            start_new_session=True, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGSTOP)
    servers._procs.append(_Proc(index=0, port=0, proc=proc))
    servers.stop(timeout_s=30)
    assert proc.returncode == 3  # its own SIGTERM handler, not the SIGKILL after the timeout


def test_a_stop_during_the_pools_close_still_stops_the_local_servers(tmp_path, monkeypatch):
    # The servers were stopped after the pool's close: a SIGTERM that cancelled the close (its
    # resume and release calls take seconds) left them to die only with the trainer process.
    import asyncio

    from _loop_kit import config
    from areal_jax.controller import servers as servers_module

    stopped = []

    class Servers:
        addresses = ["127.0.0.1:1"]

        def check_alive(self):
            pass

        def stop(self):
            stopped.append(True)

    class Pool:
        async def start(self, **_):
            pass

        async def close(self):
            self.closing.set()
            await asyncio.sleep(3600)

    pool = Pool()
    monkeypatch.setattr(servers_module, "launch_local", lambda *a, **k: Servers())
    monkeypatch.setattr(servers_module, "make_pool", lambda *a, **k: pool)

    async def main():
        async def run():
            async with servers_module.rollout_servers(config(tmp_path), tmp_path, 0):
                pass

        pool.closing = asyncio.Event()
        task = asyncio.create_task(run())
        await asyncio.wait_for(pool.closing.wait(), 10)
        task.cancel()  # the stop arrives as the pool closes
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stopped == [True]


def test_servers_started_before_one_that_cannot_start_are_stopped(tmp_path, monkeypatch):
    # A second server that could not be spawned (out of file descriptors) left the first one
    # running, with nothing left to stop it in a caller that lives on.
    from areal_jax.controller.local_servers import LocalServers

    servers = LocalServers({}, 2, tmp_path)
    started = []

    def spawn(i, cfg, name, *args):
        if i == 1:
            raise OSError(24, "Too many open files")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        start_new_session=True))
        return started[-1]

    monkeypatch.setattr(servers, "_spawn", spawn)
    with pytest.raises(OSError, match="Too many open files"):
        servers.start()
    assert len(started) == 1 and started[0].poll() is not None
    assert servers.pids == [] and servers.addresses == []
