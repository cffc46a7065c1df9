"""Fault injection with real processes and real gRPC: a rollout server SIGKILLed mid-run, an
engine failing behind a live server, a server stopped gracefully with queued work, the trainer
SIGKILLed and resumed against the servers that outlived it, a server hanging on a weight update,
a server process frozen mid-run.
In each, training reaches its last version and the run's ledger shows nothing lost and nothing
trained twice."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _loop_kit import RecordingTrainer, assert_nothing_lost, config, exports_dir, items, run_loop

from areal_jax.controller.ledger import RunLedger, read_ledger
from areal_jax.controller.local_servers import free_port
from areal_jax.controller.rollout_pool import PoolOptions

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}


def _server(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / f"server_{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(HERE / "_fake_server_main.py"), str(tmp_path),
                             str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=ENV)
    return proc, f"127.0.0.1:{port}"


def _reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _run(tmp_path, address_list, steps, during=None, options=None, prompts=None,
         addresses_file=None, **cfg):
    prompts = prompts or items(300)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    ledger = RunLedger(tmp_path / "ledger.jsonl")

    async def main():
        return await run_loop(tmp_path, config(tmp_path, {"max_staleness": 2}, **cfg), trainer,
                              address_list, prompts, steps, ledger=ledger, during=during,
                              options=options or PoolOptions(rejoin_interval_s=0.2),
                              addresses_file=addresses_file)

    try:
        loop = asyncio.run(main())
    finally:
        ledger.close()
    assert trainer.version == steps
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    return loop, trainer


def _after_first_batch(trainer_batches, action):
    async def during(loop, pool):
        while loop.version < 1:
            await asyncio.sleep(0.01)
        action()
    return during


def test_servers_listing_themselves_join_and_leave_a_running_trainer(tmp_path):
    # `serve ... register_file=F` with the trainer's rollout.addresses_file F: a server joins a
    # run by starting and leaves it by stopping, nothing else to edit, nothing lost.
    from areal_jax.protocol.addresses import read_addresses_file

    listing = tmp_path / "servers.txt"
    listing.write_text("# the rollout servers of this run\n")
    a, addr_a = _server(tmp_path, "--register", str(listing))
    procs = [a]
    seen = {}

    def until(condition, what):
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    async def during(loop, pool):  # the run is long enough for a server process to start
        b, addr_b = _server(tmp_path, "--register", str(listing))
        procs.append(b)
        seen["b"] = addr_b
        while addr_b not in pool.live_servers:
            await asyncio.sleep(0.02)
        seen["joined_at"] = loop.version
        a.send_signal(signal.SIGTERM)
        while pool.live_servers != [addr_b]:
            await asyncio.sleep(0.02)
        seen["listed"] = read_addresses_file(listing)

    try:
        until(lambda: read_addresses_file(listing) == [addr_a], "the server did not list itself")
        loop, _ = _run(tmp_path, [], 150, during=during, addresses_file=listing)
        assert a.wait(30) == 0
        assert seen["listed"] == [seen["b"]] and loop.live_at_end == [seen["b"]]
        assert seen["joined_at"] < 150  # a part of the run, not its end
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == 0
        assert read_addresses_file(listing) == []
        assert listing.read_text().startswith("# the rollout servers of this run\n")
    finally:
        _reap(*procs)


@pytest.mark.parametrize("drain_s", [0.0, 30.0])
def test_a_server_stopping_with_drain_s_finishes_its_groups_first(tmp_path, drain_s):
    # Stopped, a server sent every group it held back aborted, to be generated again elsewhere;
    # with drain_s, listed in its trainer's addresses file, it finishes them.
    from areal_jax.controller.requests import rollout_request
    from areal_jax.controller.rollout_pool import RolloutPool
    from areal_jax.protocol.addresses import read_addresses_file

    listing = tmp_path / "servers.txt"
    slow, addr_slow = _server(tmp_path, "--step-s", "0.1", "--register", str(listing),
                              "--drain-s", str(drain_s))
    fast, addr_fast = _server(tmp_path, "--register", str(listing))
    try:
        deadline = time.monotonic() + 60
        while not listing.exists() or sorted(read_addresses_file(listing)) != sorted(
                [addr_slow, addr_fast]):
            assert time.monotonic() < deadline, "the servers did not list themselves"
            time.sleep(0.05)

        async def main():
            pool = RolloutPool([], options=PoolOptions(rejoin_interval_s=0.1),
                               addresses_file=listing)
            await pool.start()
            try:
                futures = [pool.submit(rollout_request(item, f"{i}:d", "exact", 2, 6, 1.0))
                           for i, item in enumerate(items(8))]
                await asyncio.sleep(0.2)  # both hold groups
                slow.send_signal(signal.SIGTERM)
                groups = await asyncio.gather(*futures)
                return groups, pool.resubmitted
            finally:
                await pool.close()

        groups, resubmitted = asyncio.run(main())
        assert slow.wait(60) == 0
        assert all(not g.HasField("error") for g in groups)
        if drain_s:
            assert resubmitted == 0
            assert "draining" in (tmp_path / f"server_{addr_slow.split(':')[1]}.log").read_text()
        else:  # the behaviour without it: its groups came back aborted and went elsewhere
            assert resubmitted > 0
        assert read_addresses_file(listing) == [addr_fast]
    finally:
        _reap(slow, fast)


def test_a_draining_server_gets_no_new_work_though_its_address_is_fixed(tmp_path):
    # No addresses file to take it out: the server itself tells its trainers it drains. Work
    # keeps arriving; before, requests still reached it while it drained, and the groups it
    # had not finished when its drain ended were generated again elsewhere.
    from areal_jax.controller.requests import rollout_request
    from areal_jax.controller.rollout_pool import RolloutPool

    slow, addr_slow = _server(tmp_path, "--step-s", "0.05", "--drain-s", "30")
    fast, addr_fast = _server(tmp_path)
    try:
        async def main():
            pool = RolloutPool([addr_slow, addr_fast], options=PoolOptions(rejoin_interval_s=0.1))
            await pool.start()
            try:
                work = items(400)
                futures = [pool.submit(rollout_request(work[i], f"{i}:d", "exact", 2, 6, 1.0))
                           for i in range(16)]
                await asyncio.sleep(0.2)  # both hold groups
                slow.send_signal(signal.SIGTERM)
                stopped, n = time.monotonic(), 16
                while slow.poll() is None and time.monotonic() - stopped < 15:
                    # bursts: least-loaded routing would give the slow server a share of each
                    futures += [pool.submit(rollout_request(work[i], f"{i}:d", "exact", 2, 6, 1.0))
                                for i in range(n, n + 8)]
                    n += 8
                    await asyncio.sleep(0.2)
                drained_in = time.monotonic() - stopped
                groups = await asyncio.gather(*futures)
                return groups, pool.resubmitted, drained_in, pool.live_servers
            finally:
                await pool.close()

        groups, resubmitted, drained_in, live = asyncio.run(main())
        assert slow.wait(30) == 0
        assert drained_in < 10  # it ran what it held, not its whole drain_s
        assert all(not g.HasField("error") for g in groups)
        assert resubmitted == 0  # none of its groups generated twice
        assert live == [addr_fast]
    finally:
        _reap(slow, fast)


def test_sigkill_a_rollout_server_mid_run(tmp_path):
    (a, addr_a), (b, addr_b) = _server(tmp_path, "--step-s", "0.1"), _server(tmp_path)
    try:
        loop, _ = _run(tmp_path, [addr_a, addr_b], 8,
                       during=_after_first_batch(None, lambda: a.send_signal(signal.SIGKILL)))
        assert loop.live_at_end == [addr_b]
        assert loop.pool.resubmitted > 0
    finally:
        _reap(a, b)


def test_engine_failing_behind_a_live_server(tmp_path):
    (a, addr_a), (b, addr_b) = _server(tmp_path, "--die-after", "12"), _server(tmp_path)
    try:
        loop, _ = _run(tmp_path, [addr_a, addr_b], 8)
        assert loop.live_at_end == [addr_b]
        assert a.wait(20) == 1  # the server reported its dead engine and exited
    finally:
        _reap(a, b)


def test_graceful_stop_with_queued_work(tmp_path):
    (a, addr_a), (b, addr_b) = (_server(tmp_path, "--max-concurrent", "1", "--step-s", "0.05"),
                                _server(tmp_path))
    try:
        loop, _ = _run(tmp_path, [addr_a, addr_b], 8,
                       during=_after_first_batch(None, lambda: a.send_signal(signal.SIGTERM)))
        assert a.wait(20) == 0
        assert loop.live_at_end == [addr_b]
    finally:
        _reap(a, b)


def test_a_server_hanging_on_update(tmp_path):
    (a, addr_a), (b, addr_b) = _server(tmp_path, "--hang-update"), _server(tmp_path)
    try:
        start = time.monotonic()
        loop, _ = _run(tmp_path, [addr_a, addr_b], 6,
                       options=PoolOptions(update_timeout_s=1.0, rejoin_interval_s=60))
        assert loop.live_at_end == [addr_b]
        assert time.monotonic() - start < 60
        assert a.poll() is None  # still up, hung: it was left out, not waited for
    finally:
        _reap(a, b)


def test_a_frozen_server_leaves_the_pool(tmp_path):
    # A stopped process (or a dead host, a partition) keeps its connections open: nothing
    # noticed, its groups were held, and the next publish waited out update_timeout_s.
    (a, addr_a), (b, addr_b) = _server(tmp_path, "--step-s", "0.1"), _server(tmp_path)
    try:
        start = time.monotonic()
        loop, _ = _run(tmp_path, [addr_a, addr_b], 8,
                       during=_after_first_batch(None, lambda: a.send_signal(signal.SIGSTOP)),
                       options=PoolOptions(keepalive_s=1.0, rejoin_interval_s=0.2,
                                           update_timeout_s=60))
        assert loop.live_at_end == [addr_b] and loop.pool.resubmitted > 0
        assert time.monotonic() - start < 40
    finally:
        a.send_signal(signal.SIGCONT)
        _reap(a, b)


def test_sigkill_the_trainer_and_resume_against_surviving_servers(tmp_path):
    (a, addr_a), (b, addr_b) = _server(tmp_path), _server(tmp_path)
    ckpt = tmp_path / "checkpoint.json"
    cmd = [sys.executable, str(HERE / "_fake_trainer_main.py"), str(tmp_path), "20", addr_a, addr_b]
    try:
        with open(tmp_path / "trainer.log", "wb") as log:
            first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
            deadline = time.monotonic() + 120
            while not (ckpt.is_file() and json.loads(ckpt.read_text())["version"] >= 6):
                assert first.poll() is None and time.monotonic() < deadline, "trainer stalled"
                time.sleep(0.05)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            restored = json.loads(ckpt.read_text())["version"]
            second = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, timeout=180)
        assert second.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert a.poll() is None and b.poll() is None  # the servers outlived the trainer
        events = read_ledger(tmp_path / "ledger.jsonl")
        starts = [e["version"] for e in events if e["event"] == "start"]
        assert starts == [0, restored]
        # The killed run trained (and published) past its last checkpoint more often than not;
        # either way the ledger must reconcile.
        assert_nothing_lost(tmp_path / "ledger.jsonl", items(300))
    finally:
        _reap(a, b)


def test_a_ledger_torn_by_a_crash_keeps_every_event_of_the_resumed_run(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with RunLedger(path) as ledger:
        ledger.record("start", version=0)
        ledger.record("train", version=1, prompts=["a"])
    with open(path, "a") as f:
        f.write('{"event": "train", "vers')  # the crash cut this line
    with RunLedger(path) as ledger:  # the resumed run
        ledger.record("start", version=1)
        ledger.record("train", version=2, prompts=["b"])
    # The resumed run's events used to be read as nothing: its first one shared the torn line,
    # and reading stopped there.
    assert [(e["event"], e["version"]) for e in read_ledger(path)] == [
        ("start", 0), ("train", 1), ("start", 1), ("train", 2)]


def test_rejections_past_a_resumes_checkpoint_are_void_and_an_older_ledger_is_named():
    from areal_jax.controller.ledger import rejected_prompts

    def events(*spec):
        return [{"event": "start", "version": v, **({} if n is None else {"rejected": n})}
                if kind == "start" else {"event": "reject", "prompt": v}
                for kind, v, n in spec]

    assert rejected_prompts(events(("start", 0, 0), ("reject", "a", None),
                                   ("reject", "b", None), ("start", 1, 1),
                                   ("reject", "c", None))) == ["a", "c"]
    # An older ledger's first start said no count and needed none.
    assert rejected_prompts(events(("start", 0, None), ("reject", "a", None))) == ["a"]
    with pytest.raises(ValueError, match="a start at version 1 does not say how many"):
        rejected_prompts(events(("start", 0, None), ("reject", "a", None), ("start", 1, None)))


def _serving(proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while b"rollout server on" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)


def test_a_server_whose_engine_hangs_in_its_shutdown_still_exits(tmp_path):
    # The stop waited on the engine without a limit: a server whose trainer was SIGKILLed (a
    # parent-death signal or parent_pid starting the stop) kept its process, and its
    # accelerator memory, for good; a second SIGTERM only asked again.
    proc, address = _server(tmp_path, "--hang-shutdown", "--stop-margin-s", "1")
    log = tmp_path / f"server_{address.rsplit(':', 1)[1]}.log"
    try:
        _serving(proc, log)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1
        took = time.monotonic() - began
        # the fake server's shutdown_grace_s is 5; the stop is cut at 5 + 1 s
        assert 5 < took < 20, took
        assert "exiting now: the shutdown did not finish within 6 s" in log.read_text()
    finally:
        _reap(proc)
    proc, address = _server(tmp_path, "--hang-shutdown")
    log = tmp_path / f"server_{address.rsplit(':', 1)[1]}.log"
    try:
        _serving(proc, log)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while b"shutting down" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 1
        assert time.monotonic() - began < 5
        assert "exiting now: signal SIGTERM during the shutdown" in log.read_text()
    finally:
        _reap(proc)


TRAINER_WITH_THREADS = """
import subprocess, sys, threading, time
from areal_jax.processes import tied_argv
for _ in range(8):  # as a trainer's: each ends on its own when the process is SIGKILLed
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
argv = [sys.executable, sys.argv[1], sys.argv[2], sys.argv[3], "--hang-shutdown",
        "--stop-margin-s", "3", "--parent-pid", str(__import__("os").getpid())]
with open(sys.argv[4], "wb") as log:
    server = subprocess.Popen(tied_argv(argv), stdout=log, stderr=subprocess.STDOUT)
print(server.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_parents_death_signal_sent_again_does_not_cut_the_servers_shutdown(tmp_path):
    # The kernel sends the parent-death signal again each time the server passes to another
    # thread of its dying parent: the second one was taken as "exit now" and cut the shutdown
    # (engine, SGLang process group, reward pool) short.
    from _procs import alive

    port = free_port()
    log = tmp_path / "server.log"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_WITH_THREADS, str(HERE / "_fake_server_main.py"),
         str(tmp_path), str(port), str(log)], stdout=subprocess.PIPE, text=True, env=ENV)
    pid = None
    try:
        pid = int(trainer.stdout.readline())
        deadline = time.monotonic() + 60
        while b"rollout server on" not in log.read_bytes():
            assert alive(pid) and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        trainer.kill()
        trainer.wait(10)
        while b"shutting down" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        os.kill(pid, signal.SIGTERM)  # one more, sure to come during the shutdown
        while alive(pid):  # the fake engine's stop hangs: cut at its limit, 5 + 3 s
            assert time.monotonic() < deadline + 30, log.read_text()[-2000:]
            time.sleep(0.1)
        text = log.read_text()
        assert "exiting now: the shutdown did not finish within 8 s" in text, text[-2000:]
        assert "exiting now: signal SIGTERM during the shutdown" not in text
        assert text.count("the parent's death signal comes once per thread it had") == 1
    finally:
        _reap(trainer)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_with_parent_pid_a_sigterm_during_the_shutdown_never_cuts_it_and_sigint_does(
        monkeypatch):
    # The kernel sends the death signal again while the dying parent still has threads: the
    # server's parent pid has not changed yet, and the repeat cut the shutdown.
    from rollout import server
    from rollout.config import ServerConfig

    exits = []
    monkeypatch.setattr(server, "_exit_now", exits.append)
    child = ServerConfig(engine={"model_path": "m"}, parent_pid=os.getppid())
    said = []
    server._signal_during_shutdown(child, signal.SIGTERM, said)
    server._signal_during_shutdown(child, signal.SIGTERM, said)
    assert exits == [] and said == [True]  # the parent alive, as in its last threads' exits
    server._signal_during_shutdown(child, signal.SIGINT, said)
    alone = ServerConfig(engine={"model_path": "m"})  # no parent_pid: a person's signal
    server._signal_during_shutdown(alone, signal.SIGTERM, [])
    assert exits == ["signal SIGINT during the shutdown", "signal SIGTERM during the shutdown"]


def test_a_remote_server_that_cannot_serve_the_run_is_named_before_sft(tmp_path, capsys):
    # Its model, context, rewards or group size were checked only once the RL phase connected,
    # after SFT: on a real model, hours of work before a setup error.
    import yaml

    from areal_jax.cli import main

    proc, address = _server(tmp_path)
    try:
        (tmp_path / "train.jsonl").write_text(
            '{"question": "1+1?", "answer": "2", "solution": "2"}\n')
        cfg = {"run_dir": str(tmp_path / "run"), "model_path": "tiny",
               "dataset": {"path": str(tmp_path / "train.jsonl"), "reward": "math",
                           "metadata_fields": {"answer": "answer", "solution": "solution"}},
               "sft": {"steps": 3}, "rollout": {"addresses": [address]}}
        (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
        deadline = time.monotonic() + 60
        while b"rollout server on" not in (tmp_path / f"server_{address.rsplit(':', 1)[1]}.log"
                                 ).read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert main(["train", "--config", str(tmp_path / "exp.yaml")]) == 2
    finally:
        _reap(proc)
    err = capsys.readouterr().err
    assert f"rollout server {address} serves a model with a vocabulary of" in err
    assert not (tmp_path / "run" / "sft_model").exists()
    assert not (tmp_path / "run" / "sft").exists()
