"""The compile helper process: what it compiles loads in the trainer from the persistent cache,
it runs at the lowest priority, dies with its parent, and when it fails the trainer compiles
on its own."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from _procs import alive
from areal_jax.trainer.ahead import AheadCompiler
from areal_jax.trainer.compile_helper import NICE, HelperGone

TESTS = Path(__file__).parent

# A trainer on a fresh cache: with ``ahead``, six 30-token sequences are sketched and their
# programs compiled ahead before the step; then one step and one checkpoint. Prints what the
# persistent cache saw during the step and the save.
_STEP = textwrap.dedent("""
    import collections, json, sys
    import jax, numpy as np
    from areal_jax.rl import MicroBatchConfig
    from areal_jax.trainer import Trainer, TrainerConfig
    from areal_jax.trajectory import Trajectory, TrajectoryGroup
    from _trainer_kit import one_device_mesh, tiny_model

    ahead, run_dir = sys.argv[1], sys.argv[2]
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    micro = MicroBatchConfig(token_budget=256, row_buckets=(32, 64, 256))
    config = TrainerConfig(lr=1e-2, ppo_n_minibatches=1, micro_batch=micro, run_dir=run_dir,
                           checkpoint_async=False, compile_ahead=ahead != "none",
                           compile_ahead_in=ahead if ahead != "none" else "auto")
    trainer = Trainer(config, mesh=one_device_mesh(), model=tiny_model(seed=7))
    in_helper = trainer.compiles_ahead_in_helper
    if ahead != "none":
        trainer.compile_ahead_for([[30] * 6])
        assert trainer.wait_compiled_ahead(300)
    trajs = [Trajectory([1, 2, 3, 4], list(range(5, 31)), np.zeros(26), np.zeros(26),
                        reward=float(i % 3)) for i in range(6)]
    events.clear()
    metrics = trainer.train_on_batch([TrajectoryGroup("p", trajs)])
    trainer.save()
    trainer.close()
    print(json.dumps({"requests": events["/jax/compilation_cache/compile_requests_use_cache"],
                      "hits": events["/jax/compilation_cache/cache_hits"],
                      "new_shapes": metrics["packing/new_shapes"], "loss": metrics["loss"],
                      "in_helper": in_helper}))
""")


def _run_step(tmp_path: Path, ahead: str) -> dict:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / f"cache-{ahead}"),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _STEP, ahead, str(tmp_path / f"run-{ahead}")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_programs_the_helper_compiled_load_from_the_cache_instead_of_compiling(tmp_path):
    """On an empty cache, a trainer that compiles nothing ahead misses the cache for every
    program of its first step and save. With the helper, the five it compiled ahead (the
    shape's log-prob forward and accumulation, gradient zeros, optimiser update, checkpoint
    checksums) are cache hits; the step's result is the same."""
    alone, helped = _run_step(tmp_path, "none"), _run_step(tmp_path, "process")
    misses = {name: r["requests"] - r["hits"] for name, r in (("alone", alone), ("helped", helped))}
    assert alone["hits"] == 0 and misses["alone"] >= 5
    assert helped["hits"] == 5 and misses["helped"] == misses["alone"] - 5
    assert (alone["new_shapes"], helped["new_shapes"]) == (1.0, 0.0)
    assert helped["loss"] == alone["loss"]
    assert (alone["in_helper"], helped["in_helper"]) == (False, True)


# Starts the process's helper on a spec it cannot build (a TPU mesh, on a CPU machine), prints
# the error, the helper's pid, then waits to be killed.
_ORPHAN = textwrap.dedent("""
    import sys, time
    from areal_jax.trainer import TrainerConfig
    from areal_jax.trainer.compile_helper import HelperGone, shared_helper
    from areal_jax.trainer.programs import ProgramSpec
    from _trainer_kit import tiny_config

    spec = ProgramSpec(TrainerConfig(), tiny_config(), "tpu", (0,), (1,), ("fsdp",))
    helper = shared_helper(sys.argv[1])
    try:
        helper.compile(spec, ("update",))
    except HelperGone as e:
        print(str(e).splitlines()[-1], flush=True)
    print(helper.pid, flush=True)
    time.sleep(600)
""")


def test_the_helper_runs_at_the_lowest_priority_and_dies_with_its_parent(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS),
                                                        os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        error = parent.stdout.readline().strip()
        pid = int(parent.stdout.readline())
        assert "the trainer's mesh has tpu devices [0]" in error
        assert os.getpriority(os.PRIO_PROCESS, pid) == NICE
        assert len(os.sched_getaffinity(pid)) == len(os.sched_getaffinity(0))
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the compile helper outlived its SIGKILLed parent"


def test_jobs_run_in_the_helper_without_waiting_for_a_window():
    ran, jobs = [], []

    def helper(key):
        ran.append(key)
        return 0.01

    ahead = AheadCompiler(settle_s=60, helper=helper)
    assert ahead.in_helper
    assert ahead.submit("a", lambda: jobs.append("a"))
    assert ahead.wait_done(10)  # no idle window was ever opened
    assert ran == ["a"] and jobs == [] and ahead.claim("a")
    ahead.close()


def test_a_helper_that_ends_hands_its_jobs_to_the_thread():
    """The job the helper was running when it ended, and the ones after it, run on the thread,
    which (as without a helper) waits for an idle window."""
    jobs = []

    def gone(key):
        raise HelperGone("the compile helper ended (exit code -9)")

    ahead = AheadCompiler(settle_s=0, helper=gone)
    ahead.submit("a", lambda: jobs.append("a"))
    ahead.submit("b", lambda: jobs.append("b"))
    assert not ahead.wait_done(0.3) and jobs == []  # on the thread now: no window yet
    with ahead.idle():
        assert ahead.wait_done(10)
    assert jobs == ["a", "b"] and ahead.claim("a") and ahead.claim("b")
    assert not ahead.in_helper
    ahead.close()


def _helper_stuck_on(key: tuple, quick: tuple) -> tuple[AheadCompiler, threading.Event]:
    """A compiler whose helper ran one quick job ``quick`` (0.05 s, its longest so far) and
    is now stuck on ``key`` until the returned event is set."""
    release = threading.Event()

    def helper(job_key):
        if job_key == key:
            release.wait(60)
        return 0.05

    ahead = AheadCompiler(settle_s=0, helper=helper)
    ahead.submit(quick, lambda: None)
    assert ahead.wait_done(10)
    ahead.submit(key, lambda: None)
    time.sleep(0.1)  # the helper is on it
    return ahead, release


def test_a_step_waits_for_a_starved_helper_no_longer_than_its_longest_job():
    ahead, release = _helper_stuck_on(("train", (8, 512)), quick=("train", (4, 128)))
    began = time.monotonic()
    assert not ahead.claim(("train", (8, 512)))  # the caller compiles it itself
    assert time.monotonic() - began < 2
    release.set()
    ahead.close()


def test_a_quick_job_of_another_kind_does_not_cut_the_wait_for_a_train_compile():
    # The optimiser update's 0.05 s set how long a step waited for a train shape's compile
    # (10-60 s): the step gave up at once and compiled it beside the helper.
    ahead, release = _helper_stuck_on(("train", (8, 512)), quick=("update", ()))
    threading.Timer(1.0, release.set).start()
    began = time.monotonic()
    assert ahead.claim(("train", (8, 512)))  # waited for the helper's compile
    assert 0.8 < time.monotonic() - began < 10
    ahead.close()


def test_closing_waits_for_a_stuck_helper_no_longer_than_its_longest_job():
    # close() joined the worker without limit: a helper starved of CPU or stopped held the end
    # of SFT, and of the run, for as long as its job (for ever when stopped).
    ahead, release = _helper_stuck_on(("train", (2, 64)), quick=("train", (1, 64)))
    began = time.monotonic()
    ahead.close()
    assert time.monotonic() - began < 5
    release.set()


def test_compile_ahead_in_is_checked():
    from areal_jax.config import ConfigError
    from areal_jax.trainer import TrainerConfig

    with pytest.raises(ConfigError, match="compile_ahead_in must be auto, process or thread"):
        TrainerConfig(compile_ahead_in="elsewhere")


_NO_CACHE = textwrap.dedent("""
    from areal_jax.config import ConfigError
    from areal_jax.trainer import Trainer, TrainerConfig
    from _trainer_kit import one_device_mesh, tiny_model

    try:
        Trainer(TrainerConfig(compile_ahead_in="process"), mesh=one_device_mesh(),
                model=tiny_model())
    except ConfigError as e:
        print(e)
""")


def test_a_helper_needs_the_compilation_cache():
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _NO_CACHE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compile_ahead_in: process needs a single-process trainer and the persistent " \
           "compilation cache" in out.stdout

