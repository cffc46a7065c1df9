"""The reward pool kills what a killed worker's sandboxes left, and sizes code calls' limits."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from _procs import alive, marked
from areal_jax.rewards import RewardPool, code_tests, sandbox
from areal_jax.rewards.pool import SCRATCH_PREFIX, reap_orphaned_scratch
from areal_jax.rewards.code_tests import time_budget_s
from areal_jax.rewards.sandbox import SandboxLimits, reap_scratch_root, run_python


def sandboxed(completion: str, metadata: dict) -> float:
    """Runs the completion in the sandbox with a limit far beyond the pool's call timeout."""
    return float(run_python(completion, limits=SandboxLimits(timeout_s=120)).ok)


def hang(completion: str, metadata: dict) -> float:
    """A reward that never returns."""
    time.sleep(3600)
    return 0.0


def test_a_worker_inside_a_hanging_reward_dies_with_its_killed_pool(tmp_path):
    # An idle worker ends on its pipe's EOF; one inside a reward that hangs outlived the
    # SIGKILLed rollout server that started it, for good.
    code = textwrap.dedent(f"""
        import asyncio, sys
        sys.path[:0] = {sys.path!r}
        from areal_jax.rewards import RewardPool
        pool = RewardPool(1, timeout_s=600, custom={{"hang": "test_rewards_cleanup:hang"}})
        print(pool._idle[0].process.pid, flush=True)
        asyncio.run(pool.score("hang", "", {{}}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(__file__))
    worker = int(proc.stdout.readline())
    try:
        time.sleep(2)  # the call is inside the reward by now
        assert alive(worker)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)


def _sleepers(mark: str, escape: bool) -> str:
    """A program that becomes a marked sleeper, after forking one that leaves its session."""
    return textwrap.dedent(
        f"""
        import os, sys
        argv = [sys.executable, "-c", "import time; time.sleep(120)", {mark!r}]
        if {escape!r} and os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, argv)
        os.execv(sys.executable, argv)
        """
    )


def test_pool_timeout_kills_the_sandboxed_processes_and_removes_their_files(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the pool's workers keep runs
    mark = f"areal-leak-{uuid.uuid4().hex}"
    # a process leaving its session is found by uid as root, and dies with its PID namespace
    escape = os.geteuid() == 0 or sandbox.pid_isolation_available()
    expected = 2 if escape else 1

    async def main(pool):
        call = asyncio.ensure_future(pool.score("sandboxed", _sleepers(mark, escape), {}))
        for _ in range(200):
            if len(marked(mark)) == expected or call.done():
                break
            await asyncio.sleep(0.05)
        return len(marked(mark)), await call

    custom = {"sandboxed": f"{__name__}:sandboxed"}
    with RewardPool(num_workers=1, timeout_s=4.0, custom=custom) as pool:
        assert pool.score_sync("sandboxed", "pass", {}) == 1.0  # the worker is up
        running, reward = asyncio.run(main(pool))
        assert running == expected  # the sandboxed programs were running when the call timed out
        assert (reward, pool.num_timeouts) == (0.0, 1)
        assert marked(mark) == []
        # Only the replacement worker's empty scratch directory is left.
        assert [list(d.iterdir()) for d in tmp_path.iterdir()] == [[]]
        assert pool.score_sync("sandboxed", "pass", {}) == 1.0
    assert list(tmp_path.iterdir()) == []


def test_code_call_limit_covers_every_test_of_a_slow_correct_solution():
    tests = [{"input": str(i), "output": str(2 * i)} for i in range(3)]
    metadata = {"tests": tests, "timeout_s": 4}
    assert time_budget_s(metadata) == 3 * (4 + 1.0)
    assert time_budget_s({"tests": "assert True"}) == SandboxLimits().timeout_s + 1.0
    slow = "```python\nimport time\ntime.sleep(0.8)\nprint(int(input()) * 2)\n```"
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        assert pool.score_sync("code", slow, metadata) == 1.0
        assert pool.score_sync("code_fraction", slow, metadata) == 1.0
        assert pool.num_timeouts == 0


def test_metadata_cannot_lift_the_sandbox_limits_or_hold_a_worker_past_max_call_s():
    """Metadata comes with client requests: its per-test limits and case count are capped
    (the call fails naming the key), and a whole call never outlives the pool's max_call_s."""
    tests = [{"input": "", "output": "1"}]
    for extra, key in (({"timeout_s": "1e6"}, "timeout_s"), ({"memory_mb": 10**8}, "memory_mb"),
                       ({"timeout_s": "nan"}, "timeout_s"), ({"memory_mb": 0}, "memory_mb")):
        with pytest.raises(ValueError, match=f"metadata '{key}'"):
            time_budget_s({"tests": tests, **extra})
    with pytest.raises(ValueError, match="513 cases, at most 512"):
        time_budget_s({"tests": tests * 513})
    assert time_budget_s({"tests": tests, "timeout_s": 60, "memory_mb": 8192}) == 61.0
    # A JSON string decodes to many times its size, on the server's event loop: bounded too.
    huge = "[" + ",".join(["[]"] * (code_tests.MAX_TESTS_CHARS // 3 + 1)) + "]"
    with pytest.raises(ValueError, match=f"metadata 'tests': {len(huge)} characters, at most "
                                         f"{code_tests.MAX_TESTS_CHARS}"):
        time_budget_s({"tests": huge})
    with pytest.raises(ValueError, match="max_call_s must be >= timeout_s"):
        RewardPool(1, timeout_s=2.0, max_call_s=1.0)
    sleeper = "```python\nimport time\ntime.sleep(30)\nprint(1)\n```"
    with RewardPool(num_workers=1, timeout_s=1.0, max_call_s=2.0) as pool:
        assert pool.score_sync("code", sleeper, {"tests": tests * 10**4}) == 0.0  # over the cap
        assert (pool.num_errors, pool.num_timeouts) == (1, 0)
        start = time.monotonic()  # a budget of 10 x 31 s, cut at max_call_s
        assert pool.score_sync("code", sleeper, {"tests": tests * 10, "timeout_s": 30}) == 0.0
        assert pool.num_timeouts == 1 and time.monotonic() - start < 10


def test_a_groups_tests_string_is_decoded_once_for_its_time_limit(monkeypatch):
    # Every sample of a group is scored with the same metadata; its budget decoded the JSON
    # again for each (63 MiB of it: 4 s of the server's event loop per sample).
    decoded = []
    monkeypatch.setattr(code_tests.json, "loads",
                        lambda text, _loads=json.loads: decoded.append(1) or _loads(text))
    texts = [json.dumps([{"input": str(i), "output": str(g)} for i in range(5)])
             for g in range(64)]  # 64 groups scored at once, their samples interleaved
    for _ in range(8):
        for text in texts:
            assert time_budget_s({"tests": text, "timeout_s": 2}) == 5 * 3.0
    assert len(decoded) == 64
    assert time_budget_s({"tests": texts[0] + " ", "timeout_s": 2}) == 5 * 3.0  # another text
    assert len(decoded) == 65
    bad = "[" + "{}," * 3 + "{}]"  # cases without input and output: decoded once too
    for _ in range(3):
        with pytest.raises(ValueError, match=r"metadata 'tests'\[0\] must be a mapping"):
            time_budget_s({"tests": bad})
    assert len(decoded) == 66


def test_a_new_pool_reaps_the_scratch_of_a_killed_one(tmp_path, monkeypatch):
    """A pool whose process was SIGKILLed leaves its workers' directories (and any sandbox they
    ran); the next pool reaps those of dead owners and keeps those of live ones."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mark = f"areal-orphan-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os, signal, sys, tempfile, time
        sys.path[:0] = {sys.path!r}
        from areal_jax.rewards.sandbox import SandboxLimits, run_python, set_scratch_root
        scratch = tempfile.mkdtemp(prefix="{SCRATCH_PREFIX}%d-" % os.getpid(),
                                   dir={str(tmp_path)!r})
        set_scratch_root(scratch)
        if os.fork() == 0:  # a sandboxed run, recorded in the scratch, that outlives us
            run_python("import time; time.sleep(120)  # {mark}", limits=SandboxLimits(timeout_s=120))
            os._exit(0)
        deadline = time.monotonic() + 30  # until the run has recorded itself and started
        while time.monotonic() < deadline and not any(
                os.path.exists(os.path.join(scratch, n, "pid")) for n in os.listdir(scratch)):
            time.sleep(0.05)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", code], timeout=60)
    try:
        orphans = list(tmp_path.glob(f"{SCRATCH_PREFIX}*"))
        assert len(orphans) == 1 and marked(mark)
        live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-mine"
        live.mkdir()
        with RewardPool(1, timeout_s=5.0):
            pass
        assert not orphans[0].exists() and live.exists()
        deadline = time.monotonic() + 10
        while marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not marked(mark)
    finally:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)


def _victim() -> subprocess.Popen:
    """A process in a session and group of its own, as a sandboxed run's leader is."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _record(run_dir, text: str) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "pid").write_text(text)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's directory needs root")
def test_records_another_user_plants_in_the_temp_dir_kill_nothing(tmp_path):
    # A scratch directory of a dead pid, planted by another user: its records named the root
    # process group and any uid, and a new pool killed them (and every process of that uid).
    victim = _victim()
    try:
        planted = tmp_path / f"{SCRATCH_PREFIX}{_dead_pid()}-planted"
        _record(planted / "run", f"{victim.pid} -1 {sandbox._start_time(victim.pid)}\n")
        for path in (planted, planted / "run", planted / "run" / "pid"):
            os.chown(path, 65534, 65534)
        assert reap_orphaned_scratch(str(tmp_path)) == []
        assert alive(victim.pid) and planted.exists()
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("record", ["{pid} -1 {wrong}", "{pid} 0 {start}", "{pid} 1234567 {start}"])
def test_a_record_of_a_group_now_another_process_s_or_of_a_foreign_uid_kills_nothing(
        tmp_path, record):
    # A pid number taken again since the record (its leader started at another time), or a
    # uid that is not the run's sandbox uid (UID_BASE + its process group): nothing is killed,
    # the directory is still deleted.
    victim = _victim()
    try:
        start = sandbox._start_time(victim.pid)
        root = tmp_path / "scratch"
        _record(root / "run", record.format(pid=victim.pid, wrong=start - 1, start=start))
        reap_scratch_root(str(root))
        assert alive(victim.pid) and not root.exists()
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="running as a sandbox uid needs root")
def test_as_root_a_record_kills_its_uid_s_processes_that_left_its_group(tmp_path):
    # Its leader gone (its pid free, or taken by a process of another uid): the processes of
    # the run's own uid are its own, whatever their group, and are killed.
    dead = _dead_pid()
    uid = sandbox.UID_BASE + dead
    escaped = subprocess.Popen(["sleep", "60"], start_new_session=True,
                               preexec_fn=lambda: os.setuid(uid))
    try:
        root = tmp_path / "scratch"
        _record(root / "run", f"{dead} {uid} 12345")
        reap_scratch_root(str(root))
        escaped.wait(timeout=10)
        assert escaped.returncode == -signal.SIGKILL
    finally:
        escaped.kill()
        escaped.wait()
    # Its pid now leads a live run of that very uid (another pool's): that run is left alone.
    live = subprocess.Popen(["sleep", "60"], start_new_session=True,
                            preexec_fn=lambda: os.setuid(sandbox.UID_BASE + os.getpid()))
    try:
        time.sleep(0.2)  # past its exec: its uid set
        _record(tmp_path / "again" / "run",
                f"{live.pid} {sandbox.UID_BASE + live.pid} {sandbox._start_time(live.pid) - 1}")
        reap_scratch_root(str(tmp_path / "again"))
        assert alive(live.pid)
    finally:
        live.kill()
        live.wait()


def test_a_record_of_this_user_s_run_kills_its_group(tmp_path):
    victim = _victim()
    try:
        root = tmp_path / "scratch"
        _record(root / "run", f"{victim.pid} -1 {sandbox._start_time(victim.pid)}")
        reap_scratch_root(str(root))
        victim.wait(timeout=10)
        assert victim.returncode == -signal.SIGKILL and not root.exists()
    finally:
        victim.kill()
        victim.wait()


def _scratch_with_runs(root) -> None:
    for run in ("run-a", "run-b"):
        (root / run / "inner").mkdir(parents=True)
        (root / run / "inner" / "f.txt").write_text("data")


def test_reaping_finishes_when_a_run_deletes_its_own_directory_meanwhile(tmp_path, monkeypatch):
    """The killed supervisor's fork survives it, and when the reaper kills its sandbox it
    deletes its own run directory at the same time: the reaper's pass then meets a vanished
    entry, and must still delete the whole scratch."""
    root = tmp_path / "scratch"
    _scratch_with_runs(root)
    real_rmtree, passes = shutil.rmtree, []

    def racing_rmtree(path, *args, **kwargs):
        passes.append(path)
        if len(passes) == 1:  # the run's supervisor deletes its directory under the reaper
            real_rmtree(root / "run-a")
            raise FileNotFoundError(2, "No such file or directory", str(root / "run-a"))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(sandbox.shutil, "rmtree", racing_rmtree)
    reap_scratch_root(str(root))
    assert not root.exists() and len(passes) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs sandboxes under uids of their own")
def test_every_process_of_a_sandbox_uid_is_killed_in_one_call():
    # The kill scanned /proc until a scan found none: a process forking and exiting in a loop
    # (its pid moving on each time) slipped between two scans and outlived the run.
    uid = sandbox.UID_BASE + 999_999
    survivors = [subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[],
                                  start_new_session=True) for _ in range(3)]
    sandbox._kill_as(uid)
    for proc in survivors:
        assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.skipif(os.geteuid() != 0, reason="the race is root's: its chmod reaches any file")
def test_removing_a_tree_as_root_changes_no_mode_a_swapped_link_points_to(tmp_path, monkeypatch):
    # The permission repair before the removal went by path: a sandboxed process swapping a
    # directory for a link to a host directory between the check and the chmod had root chmod
    # the host tree to 0700. The race is made certain here: every entry passes for a directory.
    victim = tmp_path / "host" / "sub"
    victim.mkdir(parents=True)
    for d in (victim.parent, victim):
        d.chmod(0o755)
    tree = tmp_path / "scratch" / "run"
    tree.mkdir(parents=True)
    (tree / "swapped").symlink_to(victim.parent, target_is_directory=True)
    monkeypatch.setattr(sandbox.os.path, "islink", lambda path: False)
    sandbox._remove_tree(str(tree.parent))
    assert not tree.parent.exists()
    assert [oct(d.stat().st_mode & 0o777) for d in (victim.parent, victim)] == ["0o755"] * 2


@pytest.mark.parametrize("error", [FileNotFoundError, NotADirectoryError, RecursionError])
@pytest.mark.parametrize("rm_works", [True, False])
def test_removal_that_keeps_failing_ends_with_rm_or_a_warning(tmp_path, monkeypatch, caplog,
                                                              error, rm_works):
    # A tree the sandboxed code keeps changing (a directory swapped for a link), or nests past
    # Python's recursion limit, made the removal raise: out of the code reward, and out of
    # closing the pool; the tree stayed on disk.
    root = tmp_path / "scratch"
    _scratch_with_runs(root)
    passes = []

    def always_failing(path, *args, **kwargs):
        passes.append(path)
        raise error("the tree changed under the removal")

    monkeypatch.setattr(sandbox.shutil, "rmtree", always_failing)
    if not rm_works:
        monkeypatch.setattr(sandbox.subprocess, "run", lambda *a, **k: None)
    reap_scratch_root(str(root))
    assert len(passes) == sandbox._REMOVE_ATTEMPTS and root.exists() != rm_works
    warned = f"could not delete the sandbox directory {root} (left in place)" in caplog.text
    assert warned != rm_works



def test_workers_started_by_a_fork_server_serve():
    # A worker's parent is then the fork server, not the pool's process: the parent-death check
    # made every worker exit at once, each call scoring 0 with "worker died".
    with RewardPool(1, timeout_s=30, start_method="forkserver") as pool:
        assert pool.score_sync("synthetic_arith", "Answer: 4", {"answer": "4"}) == 1.0
        assert pool.num_errors == 0
