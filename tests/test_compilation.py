"""The persistent compilation cache, the per-step compile meter, compiling ahead."""

import functools
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.compilation import CompileMeter, compiling_ahead
from areal_jax.trainer.ahead import NICE, AheadCompiler, start_after

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from areal_jax.compilation import enable_compilation_cache
import numpy as np
from areal_jax.compilation import CompileMeter
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
enable_compilation_cache(sys.argv[1])
meter = CompileMeter()
jax.jit(lambda x: jnp.tanh(x) @ x.T * 3.5)(np.ones((24, 24), np.float32)).block_until_ready()
compiled = meter.take()
print(compiled.programs, compiled.loaded, len(hits))
"""


def _run(cache_dir) -> tuple[int, int, int]:
    """(programs compiled, programs loaded from the cache, JAX's cache hits) in a fresh
    process."""
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cache_dir)], capture_output=True,
                         text=True, check=True)
    programs, loaded, hits = out.stdout.split()
    return int(programs), int(loaded), int(hits)


def test_a_second_process_reuses_the_first_ones_programs(tmp_path):
    assert _run(tmp_path / "cache") == (1, 0, 0)  # compiled, and stored
    assert any((tmp_path / "cache").iterdir())
    # Loaded from the cache, not compiled, and the meter says so.
    assert _run(tmp_path / "cache") == (0, 1, 1)


def test_an_entry_whose_write_was_cut_short_is_removed_and_written_again(tmp_path):
    from areal_jax.compilation import SETTLED_S

    _run(tmp_path / "cache")
    (entry,) = (tmp_path / "cache").glob("*/jit_*-cache")
    intact = entry.read_bytes()
    entry.write_bytes(intact[: len(intact) // 2])  # the process writing it was killed
    # ... more than SETTLED_S ago, after the start of the process that wrote it had checked
    # the cache (the start stamps the check)
    written = time.time() - 2 * SETTLED_S
    os.utime(entry, (written, written))
    os.utime(entry.with_name(".areal-jax-checked"), (written - 1, written - 1))
    # JAX alone would read it, warn, compile and keep it, in every later run; the start
    # removes it, so this run compiles once and stores the program again, and the next loads it.
    assert _run(tmp_path / "cache") == (1, 0, 0)
    assert _run(tmp_path / "cache") == (0, 1, 1)
    # An entry written less than SETTLED_S ago (perhaps being written now) is left alone; it is
    # checked by a start after that, and an empty one goes at once.
    entry.write_bytes(intact[:10])
    assert _run(tmp_path / "cache") == (1, 0, 0)
    assert entry.read_bytes() == intact[:10]
    entry.write_bytes(b"")
    assert _run(tmp_path / "cache") == (1, 0, 0)
    assert _run(tmp_path / "cache") == (0, 1, 1)
    # An entry of another codec than this Python's (zstd where it has only zlib: another JAX
    # install sharing the cache) is checked by its own, or left alone, never taken as damaged.
    import importlib.util

    zstd_entry = entry.with_name("jit_other-0123-cache")
    zstd_entry.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 64)  # zstd's magic, then damage
    os.utime(zstd_entry, (written, written))
    os.utime(entry.with_name(".areal-jax-checked"), (written - 1, written - 1))
    _run(tmp_path / "cache")
    zstd_here = any(importlib.util.find_spec(m) for m in ("zstandard", "compression"))
    assert zstd_entry.exists() == (not zstd_here)


CACHE_SETTINGS = """
import json, os, sys
import jax
from areal_jax.compilation import enable_compilation_cache
out = []
for directory in sys.argv[1:]:
    used = enable_compilation_cache(directory)
    out.append([str(used) if used else None, os.environ["JAX_COMPILATION_CACHE_DIR"],
                jax.config.jax_compilation_cache_dir])
print(json.dumps(out))
"""


def _cache_settings(*directories) -> tuple[list, str]:
    """Per directory, in one fresh process: (the directory in use, what the processes it
    starts inherit, JAX's setting); and the process's stderr."""
    import json

    done = subprocess.run([sys.executable, "-c", CACHE_SETTINGS, *map(str, directories)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout), done.stderr


def test_the_cache_is_kept_per_host_cpu_and_found_under_any_spelling(tmp_path):
    from areal_jax.compilation import host_key

    cache = tmp_path / "cache"
    (tmp_path / "link").symlink_to(cache, target_is_directory=True)
    own = cache / host_key()
    settings, _ = _cache_settings(cache, tmp_path / "link", own)
    # Each spelling, and the host directory a launched process inherits, is the same cache.
    assert settings == [[str(own), str(own), str(own)]] * 3
    own.joinpath("jit_f-0123-cache").write_bytes(b"")  # a write that failed (disk full)
    own.joinpath("jit_g-4567-cache").write_bytes(b"x")
    _cache_settings(cache)
    assert sorted(p.name for p in own.iterdir()) == [".areal-jax-checked", "jit_g-4567-cache"]


def test_a_cache_every_user_may_write_or_no_one_can_is_not_used(tmp_path):
    # Whoever writes the cache chooses the machine code the trainer runs; and a cache that
    # could not be written threw the compile helper's work away with 39 warnings.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    group = tmp_path / "group"  # umask 002: a user's directories are group-writable
    group.mkdir(mode=0o775)
    group.chmod(0o775)
    settings, err = _cache_settings(shared, a_file, "", group)
    assert settings[:3] == [[None, "", None]] * 3 and settings[3][0].startswith(f"{group}/host-")
    assert f"the persistent compilation cache {shared}/host-" in err
    assert "is off: any user may write to" in err and "(mode 777)" in err
    assert f"{a_file}/host-" in err and "is off: NotADirectoryError" in err


def test_compile_meter_counts_new_programs_only():
    meter = CompileMeter()
    f = jax.jit(lambda x: jnp.sin(x) * 7.25 + 1)
    f(np.ones(5, np.float32)).block_until_ready()
    seconds, programs, loaded = meter.take()  # loaded: another run of the suite compiled it
    assert programs + loaded == 1 and seconds > 0
    f(np.ones(5, np.float32)).block_until_ready()  # same shape: nothing new
    assert meter.take() == (0.0, 0, 0)
    f(np.ones(6, np.float32)).block_until_ready()  # a new shape compiles again
    assert sum(meter.take()[1:]) == 1  # compiled, or loaded where another test compiled it


def test_compile_meter_counts_compiling_ahead_apart():
    meter = CompileMeter()
    f = jax.jit(lambda x: jnp.cos(x) * 5.5 - 2)
    thread = threading.Thread(target=lambda: _compile_ahead(f, np.ones(7, np.float32)))
    thread.start()
    thread.join()
    assert meter.take() == (0.0, 0, 0)
    seconds, programs, loaded = meter.take_ahead()
    assert programs + loaded == 1 and seconds > 0
    f(np.ones(7, np.float32)).block_until_ready()  # compiled ahead: the call compiles nothing
    assert meter.take() == (0.0, 0, 0) and meter.take_ahead() == (0.0, 0, 0)


def _compile_ahead(f, x):
    with compiling_ahead():
        f.lower(x).compile()


def test_ahead_compiler_runs_each_key_once_and_a_claim_waits_for_a_running_job():
    ahead = AheadCompiler(settle_s=0)
    started, release, runs = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(10)
        runs.append("slow")

    with ahead.idle():
        assert ahead.submit("a", slow)
        assert not ahead.submit("a", slow)  # queued or running: not again
        assert ahead.submit("b", lambda: runs.append("b"))
        started.wait(10)
        claimed = []
        waiter = threading.Thread(target=lambda: claimed.append(ahead.claim("a")))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # "a" is compiling: the claim waits for it
        release.set()
        waiter.join(10)
        assert claimed == [True]
        assert ahead.wait_done(10)
    assert runs == ["slow", "b"] and ahead.compiled() == {"a", "b"}
    assert not ahead.submit("b", lambda: runs.append("again"))
    ahead.close()


def test_ahead_compiler_claim_takes_a_queued_job_and_failures_fall_back(caplog):
    ahead = AheadCompiler(settle_s=0)
    runs = []
    ahead.submit("queued", lambda: runs.append("queued"))
    assert ahead.claim("queued") is False  # taken off the queue: the caller compiles it
    ahead.submit("bad", lambda: 1 / 0)
    with ahead.idle():
        assert ahead.wait_done(10)
    assert runs == [] and "bad" not in ahead.compiled()
    assert "compiling bad ahead failed" in caplog.text
    assert ahead.claim("bad") is False
    assert not ahead.submit("bad", lambda: runs.append("bad again"))
    ahead.submit("late", lambda: runs.append("late"))
    ahead.close()  # drops the queued job
    assert not ahead.submit("after", lambda: runs.append("after"))
    assert runs == []


def test_ahead_compiler_starts_a_job_once_an_idle_window_has_lasted_settle_s():
    ahead = AheadCompiler(settle_s=0.5)
    started = []
    ahead.submit("a", lambda: started.append(time.monotonic()))
    opened = time.monotonic()  # before the window opens: the compiler's clock starts inside
    with ahead.idle():
        time.sleep(0.3)
        with ahead.idle():  # a nested window does not restart the clock
            assert ahead.wait_done(10)
    assert started[0] - opened >= 0.5
    ahead.submit("b", lambda: started.append(time.monotonic()))
    with ahead.idle():
        time.sleep(0.2)  # closed before settle_s: the job does not start
    assert not ahead.wait_done(0.7) and len(started) == 1
    ahead.close()


def test_start_after_waits_for_windows_that_history_says_cover_half_a_job():
    assert start_after([], 10.0, 1.0) == 1.0  # nothing known yet: settle_s
    assert start_after([4.0] * 5, None, 1.0) == 1.0  # no job finished yet
    # Waits of 4 s, jobs of 5 s: started at 1 s, a job spills 2 s of 5: it starts.
    assert start_after([4.0] * 10, 5.0, 1.0) == 1.0
    # Jobs of 8 s would spill 5 s of 8 in such a window: only a window as long as the longest
    # seen (here 4 s) is out of what history shows.
    assert start_after([4.0] * 10, 8.0, 1.0) == 4.0
    # A synchronous trainer's one-second waits after a first long one: 1 s into a window the
    # job would spill 8.3 s on average (over the windows that lasted 1 s), and at 30 s all of
    # it: it starts only past the longest window.
    assert start_after([30.0] + [1.0] * 5, 10.0, 1.0) == 30.0
    # Short gaps and long waits mixed: past settle_s only the long waits are left, and they
    # cover a whole job.
    assert start_after([0.5] * 8 + [20.0] * 2, 6.0, 1.0) == 1.0
    # Windows of 2 s and 12 s, jobs of 6 s: started at 1 s, half the windows would spill 5 s,
    # half nothing (mean 2.5 <= 3): it starts at once.
    assert start_after([2.0, 12.0] * 4, 6.0, 1.0) == 1.0


def test_ahead_compiler_keeps_jobs_out_of_windows_shorter_than_a_job():
    ahead = AheadCompiler(settle_s=0.05)
    started = []

    def job():
        started.append(time.monotonic())
        time.sleep(0.6)

    ahead.submit("first", job)
    with ahead.idle():  # nothing known yet: the job starts after settle_s
        assert ahead.wait_done(10)
    for _ in range(5):  # the owner's usual waits: far shorter than a job
        with ahead.idle():
            time.sleep(0.1)
    ahead.submit("second", job)
    with ahead.idle():
        time.sleep(0.1)
    assert not ahead.wait_done(0.3) and len(started) == 1  # not started in a short window
    with ahead.idle():
        opened = time.monotonic()
        assert ahead.wait_done(10)
    assert len(started) == 2
    assert started[1] - opened >= 0.6  # only in a window that outlasts every one seen
    ahead.close()


def test_an_accelerator_trainers_jobs_start_as_soon_as_queued_without_a_window():
    """A trainer that is the loop's slow side never waits for rollouts: on an accelerator its
    jobs must not wait for a window that never opens."""
    ahead = AheadCompiler(settle_s=5.0, fit_to_waits=False)
    ran = []
    submitted = time.monotonic()
    ahead.submit("a", lambda: ran.append(("a", time.monotonic() - submitted)))
    ahead.submit("b", lambda: ran.append(("b", time.monotonic() - submitted)))
    assert ahead.wait_done(10)  # no idle() window was ever opened
    assert [k for k, _ in ran] == ["a", "b"] and all(t < 5.0 for _, t in ran)
    ahead.close()


def test_an_accelerator_trainers_jobs_compile_several_at_once():
    """With ``workers`` threads, that many jobs run at the same time (each compile releases
    the GIL), a claim waits for its own key only, and no key runs twice."""
    ahead = AheadCompiler(fit_to_waits=False, workers=3)
    all_in, d_ran, release = threading.Event(), threading.Event(), threading.Event()
    together = threading.Barrier(3, action=all_in.set, timeout=10)  # three jobs at once
    ran = []

    def job(key):
        together.wait()
        if key == "slow":
            release.wait(10)
        ran.append(key)

    for key in ("a", "b", "slow"):
        assert ahead.submit(key, functools.partial(job, key))
    assert ahead.submit("d", lambda: (ran.append("d"), d_ran.set()))
    assert all_in.wait(10)  # "a", "b" and "slow" ran side by side
    assert not ahead.submit("slow", lambda: ran.append("again"))  # running: not again
    assert ahead.claim("a") is True
    assert d_ran.wait(10)  # a thread freed by "a" or "b" ran "d" while "slow" still runs
    assert ahead.claim("d") is True and ahead.claim("b") is True
    assert ahead.pending() == 1  # "slow" alone
    release.set()
    assert ahead.claim("slow") is True and ahead.wait_done(10)
    assert sorted(ran) == ["a", "b", "d", "slow"]
    ahead.close()


def test_closing_without_waiting_drops_the_queue_and_a_second_close_waits_for_the_job():
    ahead = AheadCompiler(fit_to_waits=False)
    started, release, ran = threading.Event(), threading.Event(), []
    ahead.submit("running", lambda: (started.set(), release.wait(10), ran.append("running")))
    ahead.submit("queued", lambda: ran.append("queued"))
    assert started.wait(10)
    began = time.monotonic()
    ahead.close(wait=False)  # e.g. a stopping trainer, about to finish its checkpoint writes
    assert time.monotonic() - began < 1.0 and ahead.pending() == 1
    assert not ahead.submit("late", lambda: ran.append("late"))
    release.set()
    ahead.close()
    assert ran == ["running"] and ahead.pending() == 0


def test_several_workers_only_where_jobs_start_as_soon_as_queued():
    with pytest.raises(ValueError, match="workers must be 1"):
        AheadCompiler(workers=2)  # fit_to_waits: jobs share idle windows with the steps
    with pytest.raises(ValueError, match="workers must be 1"):
        AheadCompiler(fit_to_waits=False, helper=lambda key: 0.0, workers=2)
    with pytest.raises(ValueError, match="workers must be 1"):
        AheadCompiler(fit_to_waits=False, workers=0)


def test_ahead_compiler_starts_jobs_only_while_its_owner_is_idle():
    ahead = AheadCompiler(settle_s=0)
    runs, gate = [], threading.Event()
    ahead.submit("a", lambda: (gate.wait(10), runs.append("a")))
    ahead.submit("b", lambda: runs.append("b"))
    assert not ahead.wait_done(0.3)
    assert runs == [] and ahead.pending() == 2
    with ahead.idle():
        gate.set()
        assert ahead.wait_done(10)
    assert runs == ["a", "b"]
    ahead.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority: Linux")
def test_ahead_compiler_compiles_at_the_lowest_cpu_priority_and_leaves_the_caller_alone():
    ahead = AheadCompiler(settle_s=0)
    niceness = []
    ahead.submit("a", lambda: niceness.append(
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ahead.idle():
        assert ahead.wait_done(10)
    assert niceness == [NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before != NICE
    ahead.close()
