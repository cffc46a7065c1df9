"""Two processes x 4 CPU devices train as one 8-device trainer, commanded by process 0; both
restore the newest intact checkpoint together. Two processes of one device each (one GPU per
process, the common layout) do the same.

The same file is the worker: ``python tests/test_multihost.py <process_id> <port> <run_dir>
<out_dir>`` runs one process of the group.
"""

import faulthandler
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_jax.parallel import MeshConfig, make_mesh, wire
from areal_jax.rl import MicroBatchConfig
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trajectory import Trajectory

from _trainer_kit import one_device_mesh, tiny_model, toy_groups, truncate_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def _config(run_dir) -> TrainerConfig:
    return TrainerConfig(run_dir=str(run_dir), lr=1e-2, ppo_n_minibatches=2, checkpoint_keep=2,
                         micro_batch=MicroBatchConfig(token_budget=64, row_buckets=(64,)))


def _batches(n: int = 3):
    return [toy_groups(seed=s, n_groups=2, group_size=4) for s in range(n)]


def _worker(process_id: int, port: int, run_dir: Path, out: Path, mode: str) -> None:
    from areal_jax.parallel import TrainerGroup, initialize_distributed, is_leader

    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where, in the test's log
    heartbeat_s = 5 if mode in ("follower_killed", "follower_stuck") else 100
    initialize_distributed(f"127.0.0.1:{port}", 2, process_id, heartbeat_timeout_s=heartbeat_s)
    if mode == "sigterm":  # each process sends itself SIGTERM: it must end at once
        # Both joined first: a coordinator gone before the other process connected left that
        # one retrying for minutes (a loaded machine starts them far apart).
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("joined")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return
    if mode in ("config_differs", "leader_fails_early", "follower_fails_early"):
        _before_the_group(process_id, run_dir, out, mode)
        return
    import jax

    mesh = make_mesh(MeshConfig(fsdp=len(jax.devices())))  # both processes' devices
    if mode.startswith("sigterm_waiting"):
        _sigterm_while_waiting(mode, mesh, run_dir, out)
        return
    group = TrainerGroup(Trainer(_config(run_dir), mesh=mesh, model=tiny_model(seed=21)),
                         command_timeout_s=7.0 if mode == "follower_stuck" else None)
    if mode in ("follower_fails", "follower_killed"):
        _follower_fails(group, out, killed=mode == "follower_killed")
        return
    if mode == "follower_stuck":
        _follower_stuck(group, out)
        return
    if mode == "unshared":  # each process its own run_dir: a filesystem they do not share
        _unshared(process_id, mesh, run_dir, out)
        return
    if not is_leader():
        group.follow()  # until the batch every process refuses, below: then it exits 1
        return
    result = {}
    try:
        group.train_on_batch(toy_groups(seed=9, n_groups=1, group_size=1))
    except ValueError as e:  # one trajectory, two minibatches: refused before sending
        result["error"] = str(e)
    result["metrics"] = [group.train_on_batch(b) for b in _batches()]
    group.save({"data_position": 3})
    np.savez(out / "trained.npz", **group.snapshot_for_publish().tensors)
    result["metrics"].append(group.train_on_batch(_batches(4)[-1]))
    group.save({"data_position": 4})
    assert group.trainer.latest_checkpoint() == 4  # waits for the background write
    truncate_checkpoint(run_dir / "checkpoints" / "4")
    result["extra"] = group.restore()  # skips the damaged 4: version 3 on both processes
    np.savez(out / "restored.npz", **group.snapshot_for_publish().tensors)
    result["published"] = str(group.publish())
    result["again"] = group.train_on_batch(_batches(4)[-1])  # needs the restored RNG key too
    np.savez(out / "resumed.npz", **group.snapshot_for_publish().tensors)
    result["version"] = group.version
    # A batch that passes the leader's checks but fails on every process (a sequence longer
    # than the token budget): the leader raises its own error, the follower ends (exit 1) after
    # recording it, close sends nothing to the departed, and the leader exits 1 without
    # waiting in jax.distributed's shutdown barrier.
    too_long = toy_groups(seed=3, n_groups=1, group_size=2, max_output=10)
    too_long[0].trajectories[0] = Trajectory(list(range(5)), list(range(80)), [0.0] * 80, [0] * 80)
    try:
        group.train_on_batch(too_long)
    except ValueError as e:
        result["failed_everywhere"] = str(e)
    group.close()
    (out / "leader.json").write_text(json.dumps(result))


def _follower_fails(group, out: Path, killed: bool) -> None:
    """The follower's second step raises (an out-of-memory, say) before the collectives the
    leader's step is already in; or, ``killed``, the follower is SIGKILLed there (the kernel's
    out-of-memory killer) and records nothing."""
    from areal_jax.parallel import is_leader

    if not is_leader():
        step, calls = group.trainer.train_on_batch, []

        def failing(groups):
            calls.append(1)
            if len(calls) == 2:
                if killed:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise MemoryError("RESOURCE_EXHAUSTED: simulated out of memory")
            return step(groups)

        group.trainer.train_on_batch = failing
        group.follow()
        return
    result = {"trained": 0}
    try:
        for batch in _batches():
            group.train_on_batch(batch)
            result["trained"] += 1
    except RuntimeError as e:
        result["error"] = str(e)
    group.close()
    (out / "leader.json").write_text(json.dumps(result))


def _follower_stuck(group, out: Path) -> None:
    """The follower's second step hangs (a read of a hung filesystem, say), its heartbeats
    alive; the leader reports each 2 s of the command which process holds it, and ends at the
    group's 7 s command timeout."""
    from areal_jax.parallel import is_leader, trainer_group

    if not is_leader():
        step, calls = group.trainer.train_on_batch, []

        def slow(groups):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(120)
            return step(groups)

        group.trainer.train_on_batch = slow
        group.follow()
        return
    trainer_group.COMMAND_REPORT_S = 2.0
    for batch in _batches():
        group.train_on_batch(batch)
    group.close()
    (out / "leader.json").write_text(json.dumps("trained"))


def _unshared(process_id: int, mesh, run_dir: Path, out: Path) -> None:
    """Process 0 has a checkpoint in its run_dir, process 1 none in its own: both restore."""
    from areal_jax.trainer.checkpoint import CheckpointCorruptError

    own = run_dir if process_id == 0 else run_dir.with_name("run_of_process_1")
    trainer = Trainer(_config(own), mesh=mesh, model=tiny_model(seed=21))
    try:
        trainer.restore()
        outcome = "restored"
    except CheckpointCorruptError as e:
        outcome = str(e)
    (out / f"unshared_{process_id}.json").write_text(json.dumps(outcome))


def _before_the_group(process_id: int, run_dir: Path, out: Path, mode: str) -> None:
    """Work every process does before the trainer group forms: the config check, or a
    failure of one process in the leader's preparations (a run directory in use, say)."""
    from jax.experimental.multihost_utils import sync_global_devices

    from areal_jax.config import from_dict
    from areal_jax.controller.run import check_same_config
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.parallel.multihost import failure_ends_group

    try:
        if mode == "config_differs":  # process 1 was given another learning rate
            check_same_config(from_dict(ExperimentConfig, {
                "run_dir": str(run_dir), "model_path": "tiny", "dataset": {"path": "d.jsonl"},
                "distributed": True, "process_group": {"process_id": process_id},
                "trainer_cpus": [process_id],
                "trainer": {"lr": 1e-2 if process_id == 0 else 1e-3}}))
            return
        with failure_ends_group():
            if mode == f"{['leader', 'follower'][process_id]}_fails_early":
                raise MemoryError(f"simulated failure of process {process_id}")
            sync_global_devices("run directory prepared")  # the other waits here
    except Exception as e:
        (out / f"error_{process_id}.txt").write_text(f"{type(e).__name__}: {e}")
        raise


def _sigterm_while_waiting(mode: str, mesh, run_dir: Path, out: Path) -> None:
    """The leader trains a step, then waits (for rollouts) under ``run_stoppable`` as
    ``areal-jax train`` does; SIGTERM reaches the follower (``sigterm_waiting_follower``) or
    every process (``sigterm_waiting_all``). The run stops cleanly: the leader's wait ends,
    it releases the group, every process exits."""
    import asyncio

    from areal_jax.parallel import TrainerGroup, is_leader
    from areal_jax.stopping import run_stoppable, stop_on_sigterm

    stop_on_sigterm()
    group = TrainerGroup(Trainer(_config(run_dir), mesh=mesh, model=tiny_model(seed=21)),
                         command_timeout_s=7.0 if mode == "follower_stuck" else None)
    if not is_leader():
        group.follow()
        (out / "follower.json").write_text(json.dumps("released"))
        return
    group.train_on_batch(_batches(1)[0])
    (out / "trained").touch()  # the test sends its signals from here on
    started = time.monotonic()
    try:
        run_stoppable(asyncio.sleep(120))
        outcome = "not stopped"
    except KeyboardInterrupt:
        outcome = "stopped"
    finally:
        group.close()
    (out / "leader.json").write_text(json.dumps(
        {"outcome": outcome, "waited_s": time.monotonic() - started}))


def _run_group(tmp_path, mode: str, timeout: float = 300, devices: int = 4,
               during=None) -> tuple[list, list, float]:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    port = _free_port()
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port), str(run_dir), str(out),
                          mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
        for i in range(2)
    ]  # fmt: skip
    logs = []
    try:
        if during is not None:
            during(procs, out)
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    return procs, logs, time.monotonic() - start


def test_a_follower_failing_inside_a_step_ends_the_group_naming_its_error(tmp_path):
    # The leader sat in the step's collectives and the follower in the agreement's, both alive:
    # nothing ended the group (15 minutes in a reviewer's run).
    # Now the follower records its error and exits; the leader's collective either fails (it
    # raises naming the error) or waits for a peer that will not come (it ends, naming it).
    procs, logs, took = _run_group(tmp_path, "follower_fails")
    named = ("trainer-group command 'train' failed on process 1, command 'train': MemoryError: "
             "RESOURCE_EXHAUSTED: simulated out of memory")
    leader = tmp_path / "out" / "leader.json"
    assert named in (json.loads(leader.read_text())["error"] if leader.is_file() else logs[0])
    assert [p.returncode for p in procs] == [1, 1], logs
    assert took < 60  # was: until jax.distributed's heartbeat timeout (100 s), then an abort


def test_a_command_held_up_by_one_process_names_it_and_ends_at_the_timeout(tmp_path):
    # A follower stuck in a command with its heartbeats alive held every process with no
    # error and no log line, for as long as it was stuck: for ever.
    procs, logs, took = _run_group(tmp_path, "follower_stuck", timeout=120)
    reports = re.findall(r"trainer-group command 'train' has run for (\d+) s; processes yet to "
                         r"finish it: (.*)", logs[0])
    assert len(reports) >= 2 and {who for _, who in reports} == {"1"}, logs[0][-3000:]
    assert re.search(r"trainer-group command 'train' has not finished in [78] s "
                     r"\(process_group.command_timeout_s\); processes yet to finish it: 1\. ",
                     logs[0]), logs[0][-3000:]
    assert procs[0].returncode == 1 and procs[1].returncode != 0
    assert not (tmp_path / "out" / "leader.json").exists()
    assert took < 60, took  # the follower at the heartbeat timeout (5 s), not after its 120 s


def test_a_killed_follower_ends_the_group_at_the_heartbeat_timeout(tmp_path):
    # A follower SIGKILLed inside a step records no error: the leader waits in the step's
    # collectives until jax.distributed misses the follower's heartbeats
    # (process_group.heartbeat_timeout_s, 5 s here) and ends it, naming the task.
    procs, logs, took = _run_group(tmp_path, "follower_killed")
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0, logs[0][-3000:]
    assert "stopped sending heartbeats" in logs[0], logs[0][-3000:]
    assert not (tmp_path / "out" / "leader.json").exists()  # it never got past the step
    assert took < 80, took  # not at jax.distributed's default 100 s


def test_a_process_with_another_config_is_refused_by_every_process(tmp_path):
    # Each process built its trainer from its own config: a follower given another learning
    # rate stepped its parameter shards with it, and both exited 0 with weights matching
    # neither rate.
    procs, logs, _ = _run_group(tmp_path, "config_differs", timeout=120)
    assert [p.returncode for p in procs] == [1, 1], logs
    errors = [(tmp_path / "out" / f"error_{i}.txt").read_text() for i in (0, 1)]
    assert errors[1].startswith("ConfigError: this trainer process's settings differ from the "
                                "leader's (process 0) at: trainer.lr;"), errors[1]
    assert "only process_group, trainer_cpus, trainer_devices" in errors[1]
    assert errors[0].startswith("ConfigError: another trainer process's settings differ from "
                                "this one's: process 1 differs from process 0 at trainer.lr;")


@pytest.mark.parametrize("failing", ["leader", "follower"])
def test_a_process_failing_before_the_group_forms_ends_every_process_at_once(tmp_path, failing):
    # A refused run directory on the leader, or an error in SFT on a follower: the failing
    # process waited in jax.distributed's shutdown barrier, the other in a collective, both
    # until the barrier's 300 s timeout, then an abort naming nothing.
    procs, logs, took = _run_group(tmp_path, f"{failing}_fails_early", timeout=200)
    assert all(p.returncode != 0 for p in procs), logs
    assert took < 60, (took, logs)
    failed = 0 if failing == "leader" else 1
    assert (tmp_path / "out" / f"error_{failed}.txt").read_text() == (
        f"MemoryError: simulated failure of process {failed}")
    if failing == "follower":  # the leader names it (the leader's own failure ends the
        # coordination service the follower would read it from)
        assert (tmp_path / "out" / "error_0.txt").read_text() == (
            "RuntimeError: another trainer process failed: process 1: MemoryError: simulated "
            "failure of process 1")


@pytest.mark.parametrize("signalled", ["follower", "all"])
def test_sigterm_while_the_leader_waits_stops_the_run_cleanly(tmp_path, signalled):
    # SIGTERM to a follower only: it exited at once, and the leader learned of it at the
    # heartbeat timeout (84 s later), aborting. SIGTERM to every process (a scheduler's stop):
    # the followers exited, the leader's release of the group failed and it aborted 80 s later.
    def signal_after_the_step(procs, out):
        deadline = time.monotonic() + 150
        while not (out / "trained").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in procs if signalled == "all" else procs[1:]:
            p.send_signal(signal.SIGTERM)

    procs, logs, _ = _run_group(tmp_path, f"sigterm_waiting_{signalled}", timeout=200,
                                during=signal_after_the_step)
    leader = json.loads((tmp_path / "out" / "leader.json").read_text())
    assert leader["outcome"] == "stopped" and leader["waited_s"] < 30, (leader, logs)
    assert json.loads((tmp_path / "out" / "follower.json").read_text()) == "released"
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "could not release" not in logs[0]


def test_processes_that_see_different_checkpoints_refuse_to_restore(tmp_path):
    # Each read its own listing: process 0 restored checkpoint 1 and waited in its collectives,
    # process 1 restored nothing and went on (150 s and counting in a reviewer's run).
    single = Trainer(_config(tmp_path / "run"), mesh=one_device_mesh(), model=tiny_model(seed=21))
    single.save({"data_position": 1})
    single.close()
    procs, logs, _ = _run_group(tmp_path, "unshared", timeout=200)
    for i in range(2):
        outcome = json.loads((tmp_path / "out" / f"unshared_{i}.json").read_text())
        assert "the trainer processes see different checkpoints" in outcome, logs[i][-2000:]
        assert "run_dir must be on a filesystem every process shares" in outcome
    assert "this one: [0]" in json.loads((tmp_path / "out" / "unshared_0.json").read_text())


def test_sigterm_ends_a_process_of_the_group(tmp_path):
    # jax.distributed's preemption service took SIGTERM over: the processes went on.
    procs, logs, took = _run_group(tmp_path, "sigterm", timeout=120)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2, logs
    assert took < 50  # each would sleep 60 s after its SIGTERM


def test_a_process_whose_group_never_forms_says_what_it_waits_for_and_ends(tmp_path):
    # Alone (the other process never started), a process waited jax.distributed's fixed 300 s
    # and was aborted with a bare DEADLINE_EXCEEDED and a C++ stack trace.
    code = ("from areal_jax.parallel.multihost import initialize_distributed; "
            f"initialize_distributed('127.0.0.1:{_free_port()}', 2, 0, join_timeout_s=3)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert ("joining the trainer's process group as process 0 of 2, coordinator 127.0.0.1:"
            in done.stderr) and "waiting up to 3 s for every process" in done.stderr
    assert "DEADLINE_EXCEEDED" in done.stderr
    assert time.monotonic() - start < 60


def test_with_one_process_the_group_is_the_trainer(tmp_path):
    from areal_jax.parallel import TrainerGroup

    config = _config(tmp_path)
    plain = Trainer(config, mesh=one_device_mesh(), model=tiny_model(seed=5))
    group = TrainerGroup(Trainer(config, mesh=one_device_mesh(), model=tiny_model(seed=5)))
    batch = _batches(1)[0]
    assert group.train_on_batch(batch)["loss"] == plain.train_on_batch(batch)["loss"]
    assert group.version == 1
    with pytest.raises(ValueError, match="ppo_n_minibatches=2 is more than the 1 trajectories"):
        group.train_on_batch(toy_groups(seed=9, n_groups=1, group_size=1))
    with pytest.raises(RuntimeError, match=r"follow\(\) runs on the processes other than 0"):
        group.follow()


def test_closing_the_group_waits_for_the_command_in_flight():
    # The controller runs a step on a worker thread; if the run stops meanwhile, close() must
    # not send its message (a collective) while the step's collectives are still running, nor
    # close the trainer under it.
    import threading

    from areal_jax.parallel import TrainerGroup

    release, events = threading.Event(), []

    class SlowTrainer:
        version = 0

        def check_batch(self, groups):
            pass

        def train_on_batch(self, groups):
            events.append("step started")
            release.wait(10)
            events.append("step ended")
            return {}

        def close(self):
            events.append("closed")

    group = TrainerGroup(SlowTrainer())
    step = threading.Thread(target=group.train_on_batch, args=([],))
    step.start()
    while not events:
        time.sleep(0.01)
    closer = threading.Thread(target=group.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and events == ["step started"]
    release.set()
    closer.join(10)
    step.join(10)
    assert events == ["step started", "step ended", "closed"]


def test_a_collective_broken_by_a_peer_that_recorded_nothing_is_named_not_a_traceback(
        monkeypatch, capsys):
    # A follower SIGKILLed mid-step on CPU: Gloo's collective failed at once on the leader,
    # which ended with a 90-line traceback naming no process and no way on.
    import jax

    from areal_jax.cli import _user_errors
    from areal_jax.parallel import trainer_group
    from areal_jax.parallel.trainer_group import TrainerGroup, TrainerGroupBrokenError

    class BrokenTrainer:
        version = 0

        def check_batch(self, groups):
            pass

        def train_on_batch(self, groups):
            raise jax.errors.JaxRuntimeError(
                "UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer\nmore")

    monkeypatch.setattr(trainer_group, "skip_shutdown_barrier", lambda: None)  # not at exit
    monkeypatch.setattr(trainer_group, "peer_failure_behind", lambda e: None)
    group = TrainerGroup(BrokenTrainer())
    group._multi = True  # as the leader of two: its collectives are the trainer's here
    with pytest.raises(TrainerGroupBrokenError) as broken:
        group._agree("train", lambda: group.trainer.train_on_batch([]))
    assert str(broken.value) == (
        "trainer-group command 'train' failed: a collective with the other trainer processes "
        "broke (UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer), none "
        "of them having recorded an error: one was killed (SIGKILL, the out-of-memory killer) "
        "or its host or network went down. The group cannot go on: start the same command on "
        "every process again, and the run resumes from its last checkpoint")
    assert isinstance(broken.value, _user_errors())  # one line from the command, no traceback
    with pytest.raises(RuntimeError, match="the trainer group ended when a command failed"):
        group.train_on_batch([])
    # The leader's own failure (its memory) is not blamed on the others: it keeps its error.
    own = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB")
    group = TrainerGroup(BrokenTrainer())
    group._multi = True

    def out_of_memory():
        raise own

    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        group._agree("train", out_of_memory)
    assert raised.value is own


def test_a_process_of_a_slurm_job_keeps_every_device_it_sees(monkeypatch):
    # Given no local_device_ids, jax.distributed restricts a SLURM or Open MPI process to the
    # device of its local rank: one GPU of eight per host, with no error.
    import jax

    from areal_jax.parallel import initialize_distributed

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda name, value: seen.update({name: value}))
    monkeypatch.setenv("SLURM_LOCALID", "0")
    initialize_distributed("10.0.0.1:1234", 4, 2)
    assert seen["local_device_ids"] == []  # not None: no restriction (None is the local rank's)
    assert (seen["coordinator_address"], seen["num_processes"], seen["process_id"]) == (
        "10.0.0.1:1234", 4, 2)
    assert seen["heartbeat_timeout_seconds"] == 100  # process_group.heartbeat_timeout_s
    assert seen["initialization_timeout"] == 300  # process_group.join_timeout_s


def test_trajectory_groups_cross_the_wire_unchanged():
    groups = toy_groups(seed=4, n_groups=2, group_size=3)
    groups[1].trajectories[0].output_mask[:2] = 0
    groups[1].trajectories[2].finish_reason = "length"
    header, arrays = wire.groups_to_message(groups)
    data = wire.pack_message({"command": "train", **header}, arrays)
    header, arrays = wire.unpack_message(data)
    assert header.pop("command") == "train"
    back = wire.groups_from_message(header, arrays)
    assert [g.group_id for g in back] == ["g0", "g1"]
    for g, h in zip(groups, back):
        for t, u in zip(g.trajectories, h.trajectories, strict=True):
            for name in ("prompt_ids", "output_ids", "behav_logprobs", "versions", "output_mask"):
                np.testing.assert_array_equal(getattr(u, name), getattr(t, name), err_msg=name)
                assert getattr(u, name).dtype == getattr(t, name).dtype
            assert (u.reward, u.finish_reason) == (t.reward, t.finish_reason)
    examples = [([1, 2], [3]), ([4], [5, 6, 7])]
    assert wire.examples_from_message(*wire.examples_to_message(examples)) == examples
    with pytest.raises(TypeError, match="cannot send a float64 array"):
        wire.pack_message({}, [np.zeros(2)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("devices", [4, 1])
def test_two_processes_train_like_one_and_restore_together(tmp_path, devices):
    # With one device per process the first checkpoint failed on both ("an argument array had
    # 2 shard(s)"): the RNG key was placed from a single-device array.
    run_dir, out = tmp_path / "run", tmp_path / "out"
    procs, logs, _ = _run_group(tmp_path, "train", devices=devices)
    # The group broke on purpose at the end: the leader exits 1; the follower exits 1 after
    # its own error, or is ended by JAX's coordination agent when the leader left first.
    assert procs[0].returncode == 1, logs[0][-3000:]
    assert procs[1].returncode in (1, -signal.SIGABRT), logs[1][-3000:]

    # The same steps on one process with the same 8-device mesh shape.
    single = Trainer(_config(tmp_path / "single"), mesh=make_mesh(MeshConfig(fsdp=8)),
                     model=tiny_model(seed=21))
    expected = [single.train_on_batch(b) for b in _batches()]
    reference = single.snapshot_for_publish().tensors
    expected.append(single.train_on_batch(_batches(4)[-1]))

    leader = json.loads((out / "leader.json").read_text())
    assert "ppo_n_minibatches=2 is more than the 1 trajectories" in leader["error"]
    for got, want in zip(leader["metrics"], expected, strict=True):
        for key in ("loss", "grad_norm", "ppo/entropy", "version"):
            # fp32 rounding of differently ordered sums.
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, err_msg=key)
        # approx_kl (about 6e-3) is a mean of small differences of O(1) log-probs: their
        # rounding is absolute, about 1e-6 here (2e-4 of the value on this machine's CPU).
        np.testing.assert_allclose(got["ppo/approx_kl"], want["ppo/approx_kl"], rtol=0, atol=1e-5)
    trained = np.load(out / "trained.npz")
    assert sorted(trained.files) == sorted(reference)
    _assert_close(trained, reference)
    assert not np.allclose(trained["lm_head.weight"], tiny_model(seed=21).lm_head[...].T, atol=1e-3)

    assert leader["extra"] == {"data_position": 3}
    restored = np.load(out / "restored.npz")
    for name in trained.files:
        np.testing.assert_array_equal(restored[name], trained[name], err_msg=name)
    assert leader["again"]["loss"] == leader["metrics"][-1]["loss"]  # same state, same split
    assert Path(leader["published"]) == run_dir / "exports" / "v000003"
    assert (Path(leader["published"]) / "model.safetensors").is_file()
    assert leader["version"] == 4
    # Each process failed with its own error for the batch all refused, and nobody waited for
    # the heartbeat timeouts (the processes ended within the communicate() limit above).
    assert "85 tokens, more than the micro-batch token budget 64" in leader["failed_everywhere"]

    _assert_close(np.load(out / "resumed.npz"), single.snapshot_for_publish().tensors)


def _assert_close(got, want) -> None:
    """Parameters equal up to 1e-3 (a tenth of one lr=1e-2 step), and 99.9% of them up to
    1e-4: the programs are the same, only the order of cross-device sums differs (in-process
    vs gloo all-reduce), and Adam's m / sqrt(v) turns those fp32 roundings of small gradient
    entries into parameter differences (measured up to 1e-4 on one CPU, a single entry of
    3.7e-4 on another). A wrong or missing batch shard moves parameters by whole lr steps."""
    for name in want:
        diff = np.abs(np.asarray(got[name], np.float64) - np.asarray(want[name], np.float64))
        assert diff.max() <= 1e-3, (name, diff.max())
        assert np.mean(diff <= 1e-4) >= 0.999, (name, np.mean(diff <= 1e-4))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]),
            sys.argv[5])
