"""The code sandbox: limits, isolation and clean-up, and the code reward built on it."""

import dataclasses
import errno
import json
import os
import socket
import textwrap
import time
import uuid

import pytest

from _procs import marked
from areal_jax.rewards import sandbox
from areal_jax.rewards.code_tests import code_fraction_reward, code_reward, extract_code, run_tests
from areal_jax.rewards.sandbox import (
    MINIMAL_PATH,
    SandboxLimits,
    network_isolation_available,
    pid_isolation_available,
    run_python,
    set_scratch_root,
)

FAST = SandboxLimits(timeout_s=3.0)

SQUARE_CASES = [{"input": "3\n", "output": "9\n"}, {"input": "12\n", "output": "144"}]


def _group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(name))
    return members


def _uid_members(uid: int) -> list[int]:
    """Processes running as ``uid`` with a thread alive (a zombie leader counts while one runs)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                real = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if real == uid and _threads_alive(int(name)):
            found.append(int(name))
    return found


@pytest.fixture
def runs(monkeypatch) -> list[tuple[int, int | None]]:
    """(process group, sandbox uid or None) of each run, as the host numbers them: in a PID
    namespace of its own the code sees other pids (its first process is 1)."""
    seen = []
    kill_tree = sandbox._kill_tree

    def recording(pgid, uid):
        seen.append((pgid, uid))
        kill_tree(pgid, uid)

    monkeypatch.setattr(sandbox, "_kill_tree", recording)
    return seen


def test_correct_solution_passes_io_and_assert_tests():
    assert run_tests("print(int(input()) ** 2)", SQUARE_CASES, FAST) == (2, 2)
    asserts = "assert square(4) == 16\nassert square(-2) == 4"
    assert run_tests("def square(x):\n    return x * x", asserts, FAST) == (1, 1)
    completion = "Here it is:\n```python\nprint(int(input()) ** 2)\n```\nDone."
    assert code_reward(completion, {"tests": SQUARE_CASES}) == 1.0
    assert code_reward(completion, {"tests": json.dumps(SQUARE_CASES)}) == 1.0


def test_wrong_solution_fails_and_fraction_counts_passed_cases():
    wrong = "```python\nn = int(input())\nprint(9 if n == 3 else 0)\n```"
    assert code_reward(wrong, {"tests": SQUARE_CASES}) == 0.0
    assert code_fraction_reward(wrong, {"tests": SQUARE_CASES}) == 0.5
    assert (
        code_reward("def square(x):\n    return x + x", {"tests": "assert square(3) == 9"}) == 0.0
    )
    crashing = "```python\nraise SystemExit(1)\n```"
    assert code_fraction_reward(crashing, {"tests": SQUARE_CASES}) == 0.0


@pytest.mark.parametrize("ending", [
    "import os\nos._exit(0)", "raise SystemExit(0)", "exit(0)",
    "import atexit, os\natexit.register(lambda: os._exit(0))",
    "import builtins\nbuiltins.exec = lambda *a, **k: None",
    "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda s, f, m: _c('pass', f, m)",
    "import os, sys\nsys.stdout.write(os.pread(0, 64, 0).decode())\nos._exit(0)",
    "import os, sys\nsys.stdout.write(open('../io/stdin').read())\nos._exit(0)"])
def test_a_solution_ending_the_process_before_the_asserts_passes_nothing(ending):
    # Exit status 0 was the pass: ending early with it scored 1.0 against any asserts; then
    # replacing the exec the harness ran the tests with, or reading its token back.
    wrong = f"def square(x):\n    return x + x\n{ending}\n"
    assert code_reward(f"```python\n{wrong}```", {"tests": "assert square(3) == 9"}) == 0.0


def test_assert_tests_see_the_solution_as_a_main_program_with_its_output():
    solution = ("import sys\ndef square(x):\n    return x * x\nprint('talking', end='')\n"
                "if __name__ == '__main__':\n    sys.stderr.write('main\\n')\n")
    assert run_tests(solution, "assert square(4) == 16\nprint('done')", FAST) == (1, 1)


def test_a_tree_of_thousands_of_nested_directories_is_removed_and_raises_nothing(tmp_path):
    # Past Python's recursion limit (and the path length), its removal raised RecursionError
    # out of the reward, lost the pool's worker, and left the tree on disk.
    code = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint(9)\n"
    set_scratch_root(str(tmp_path))
    try:
        result = run_python(code, limits=FAST)
    finally:
        set_scratch_root(None)
    assert result.ok and result.stdout.strip() == "9"
    assert os.listdir(tmp_path) == []


def test_extract_code_prefers_last_python_block():
    text = "```\nplain\n```\n```python\nfirst\n```\n```py\nsecond\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```text\nonly\n```") == "only\n"
    assert extract_code("print(1)") == "print(1)"


def test_bad_tests_metadata_is_rejected_with_the_problem():
    with pytest.raises(ValueError, match=r"'tests'\[0\]"):
        run_tests("print(1)", [{"input": ""}], FAST)
    with pytest.raises(KeyError, match="tests"):
        code_reward("print(1)", {})


def test_infinite_loop_is_killed_within_the_timeout():
    limits = SandboxLimits(timeout_s=1.0)
    result = run_python("while True:\n    pass\n", limits=limits)
    assert result.timed_out and not result.ok
    assert result.elapsed_s < limits.timeout_s + 3.0  # the margin: starting the jail under load
    sleeper = run_python("import time\ntime.sleep(60)\n", limits=limits)
    assert sleeper.timed_out and sleeper.elapsed_s < limits.timeout_s + 3.0
    slow = code_reward("while True: pass", {"tests": SQUARE_CASES, "timeout_s": 1})
    assert slow == 0.0


def test_memory_bomb_is_stopped():
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=256 << 20)
    result = run_python(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n", limits=limits
    )
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr
    small = run_python("x = bytearray(64 << 20)\nprint(len(x))", limits=limits)
    assert small.ok and small.stdout.strip() == str(64 << 20)


def test_fork_bomb_is_stopped_by_the_process_limit(runs):
    limits = SandboxLimits(timeout_s=5.0, max_processes=6)
    counting = textwrap.dedent(
        """
        import os, time
        made = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            made += 1
        print(made)
        """
    )
    result = run_python(counting, limits=limits)
    assert result.ok
    assert int(result.stdout) < limits.max_processes

    bomb = textwrap.dedent(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    )
    result = run_python(bomb, limits=SandboxLimits(timeout_s=1.5, max_processes=6))
    assert result.timed_out
    assert _group_members(runs[-1][0]) == []


def test_huge_file_write_is_stopped():
    limits = SandboxLimits(timeout_s=5.0, max_file_bytes=4 << 20)
    writer = textwrap.dedent(
        """
        written = 0
        try:
            with open("big.bin", "wb", buffering=0) as f:
                for _ in range(64):
                    written += f.write(b"x" * (1 << 20))
        except OSError as e:
            print("stopped", e.errno)
        print(written)
        """
    )
    result = run_python(writer, limits=limits)
    lines = result.stdout.split()
    assert lines[0] == "stopped"
    assert int(lines[-1]) <= limits.max_file_bytes
    unguarded = run_python("open('big.bin', 'wb').write(b'x' * (8 << 20))", limits=limits)
    assert not unguarded.ok and "File too large" in unguarded.stderr


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    result = run_python("import json, os\nprint(json.dumps(dict(os.environ)))", limits=FAST)
    env = json.loads(result.stdout)
    assert "AREAL_SECRET_TOKEN" not in env
    assert env["PATH"] == MINIMAL_PATH
    assert set(env) <= {"PATH", "LC_CTYPE"}  # LC_CTYPE: Python's own C-locale coercion


def test_cwd_is_a_private_temp_dir_that_is_removed(tmp_path):
    code = textwrap.dedent(
        """
        import os
        os.makedirs("locked/inner")
        open("locked/inner/f.txt", "w").write("data")
        os.chmod("locked", 0)
        print(os.getcwd())
        print(sorted(os.listdir(".")))
        """
    )
    set_scratch_root(str(tmp_path))
    try:
        first = run_python(code, limits=FAST)
        second = run_python(code, limits=FAST)
    finally:
        set_scratch_root(None)
    cwd, listing = first.stdout.splitlines()
    assert first.ok and second.ok and listing == "['locked', 'main.py']"
    if first.fs_isolated:
        assert cwd == "/sandbox"  # the jail's view of the run's own directory
    else:
        assert os.path.dirname(os.path.dirname(cwd)) == str(tmp_path)
        assert cwd != second.stdout.splitlines()[0]
    assert os.listdir(tmp_path) == []


def test_child_left_behind_is_killed_with_the_group():
    mark = f"areal-left-{uuid.uuid4().hex}"
    code = textwrap.dedent(
        f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {mark!r}])
        """
    )
    result = run_python(code, limits=FAST)
    assert result.ok and not result.timed_out
    assert result.elapsed_s < FAST.timeout_s
    assert marked(mark) == []


@pytest.mark.parametrize("main_thread", ["runs", "exits"])
def test_a_process_that_leaves_the_group_is_killed_when_uid_or_pid_isolated(main_thread, runs):
    # One that made itself non-dumpable (its /proc entries then belong to root); one whose main
    # thread exited while another runs on (it shows as a zombie): the clean-up skipped it, and
    # it outlived the run (holding memory, racing the removal of the run's directory).
    mark = f"areal-escape-{uuid.uuid4().hex}"
    left = {  # PR_SET_DUMPABLE 0; SYS_exit: the main thread alone
        "runs": "import ctypes, time; ctypes.CDLL(None).prctl(4, 0); time.sleep(60)",
        "exits": "import ctypes, threading, time; "
                 "threading.Thread(target=time.sleep, args=(60,)).start(); "
                 "ctypes.CDLL(None).syscall(60, 0)"}[main_thread]
    code = textwrap.dedent(
        f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", {left!r}, {mark!r}])
        time.sleep(0.5)
        """
    )
    result = run_python(code, limits=FAST)
    if not (result.uid_isolated or result.pid_isolated):
        pytest.skip("found by neither a uid of its own nor a PID namespace here")
    assert marked(mark) == []
    if result.uid_isolated:
        deadline = time.monotonic() + 5
        while _uid_members(runs[-1][1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _uid_members(runs[-1][1]) == []


def test_code_under_the_callers_uid_can_signal_no_process_outside_its_run(monkeypatch):
    # Without root the code runs as the caller's uid: it could kill the rollout server, and a
    # process that left its process group outlived the run, until runs got PID namespaces.
    if not pid_isolation_available():
        pytest.skip("no PID namespace can be made here")
    as_caller = sandbox._Isolation(
        as_root=False,
        unshare_flags=sandbox._CLONE_NEWUSER | sandbox._CLONE_NEWNET | sandbox._CLONE_NEWPID,
    )
    monkeypatch.setattr(sandbox, "_isolation", lambda: as_caller)
    mark = f"areal-escape-{uuid.uuid4().hex}"
    code = textwrap.dedent(
        f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)",
                                      {mark!r}])
        try:
            os.kill({os.getpid()}, 0)
            print("reached the caller")
        except ProcessLookupError:
            print("no such process")
        print(os.getpid())
        """
    )
    result = run_python(code, limits=FAST)
    assert result.pid_isolated and not result.uid_isolated
    assert result.stdout.split() == ["no", "such", "process", "1"], result.stderr
    assert marked(mark) == []


def test_a_crash_of_the_code_writes_no_core_dump(monkeypatch):
    # In a PID namespace the process outside ends by the code's signal: with the caller's
    # core limit it dumped the caller's memory (a GiB per crashing completion here).
    import resource

    before = resource.getrlimit(resource.RLIMIT_CORE)
    left = []
    remove = sandbox._remove_tree

    def listing_then_removing(path):
        left.extend(name for _, _, names in os.walk(path) for name in names)
        remove(path)

    monkeypatch.setattr(sandbox, "_remove_tree", listing_then_removing)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        result = run_python("import ctypes; ctypes.string_at(0)", limits=FAST)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, before)
    assert result.returncode == -11
    assert not [name for name in left if name.startswith("core")], left


def test_processes_the_code_makes_the_callers_children_are_reaped():
    # clone(CLONE_PARENT) made them children of the reward worker: killed, they stayed its
    # zombies, 15 pids more per completion until the host ran out.
    code = textwrap.dedent(
        """
        import ctypes, time
        libc = ctypes.CDLL(None)
        for _ in range(5):
            if libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0) == 0:  # clone(CLONE_PARENT | SIGCHLD)
                while True:
                    libc.pause()
        print("ok")
        """
    )
    result = run_python(code, limits=FAST)
    assert result.stdout.strip() == "ok"
    mine = str(os.getpid())
    zombies = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if fields[1] == mine and fields[0] == "Z":
            zombies.append(name)
    assert zombies == []


def _threads_alive(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    states = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            continue
    return any(state not in ("Z", "X") for state in states)


def test_caller_files_are_not_writable_when_uid_isolated(tmp_path):
    target = tmp_path / "owned.txt"
    target.write_text("keep")
    tmp_path.chmod(0o755)
    target.chmod(0o644)
    result = run_python(f"open({str(target)!r}, 'w').write('gone')", limits=FAST)
    if not result.uid_isolated:
        pytest.skip("the sandbox runs under the caller's uid here (not root)")
    assert "PermissionError" in result.stderr or "FileNotFoundError" in result.stderr
    assert target.read_text() == "keep"


def test_network_is_unreachable():
    if not network_isolation_available():
        pytest.skip("this kernel/user cannot create a network namespace; the sandbox has network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = textwrap.dedent(
            f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port}))
                print("connected")
            except OSError as e:
                print("refused", e.errno)
            """
        )
        result = run_python(code, limits=FAST)
    assert result.network_isolated
    assert result.stdout.startswith("refused")


def _host_shm_sizes() -> list[int]:
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return [int(line.split()[3]) for line in f]


def test_memory_no_address_space_limit_counts_is_refused():
    # Anonymous memory files written through write(), System V segments touched and detached,
    # System V message queues are mapped nowhere, so RLIMIT_AS did not count them: 40 memfds of
    # 15 MiB held 600 MiB under a 64 MiB limit (about 1 GiB a process, 16 processes a run);
    # 20000 queues of 16 KB, 305 MiB.
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("the filter knows the system-call numbers of x86-64 and arm64 only")
    code = textwrap.dedent(
        """
        import ctypes, os, platform
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            os.memfd_create("held")
            print("memfd made")
        except OSError as e:
            print("memfd", e.errno)
        print("shmget", libc.shmget(0, 1 << 20, 0o1000 | 0o600), ctypes.get_errno())
        print("msgget", libc.msgget(0, 0o1000 | 0o600), ctypes.get_errno())
        print("semget", libc.semget(0, 1, 0o1000 | 0o600), ctypes.get_errno())
        if platform.machine() == "x86_64":  # memfd_create by its x32 number
            print("x32", libc.syscall(0x40000000 | 319, b"held", 0), ctypes.get_errno())
        """
    )
    result = run_python(code, limits=FAST)
    assert result.memory_files_refused
    assert result.ok, result.stderr
    lines = result.stdout.split("\n")
    assert lines[:4] == [f"memfd {errno.EPERM}", f"shmget -1 {errno.EPERM}",
                         f"msgget -1 {errno.EPERM}", f"semget -1 {errno.EPERM}"]
    if lines[4].startswith("x32"):
        assert lines[4] == f"x32 -1 {errno.EPERM}"


def test_shared_memory_the_code_leaves_goes_with_the_run(monkeypatch):
    # A segment created and detached counts against no address-space limit and outlived the
    # run, its uid's processes and its directory: every reward call could leave more. (Where
    # the system-call filter refuses shmget no segment is made; this is the IPC namespace's
    # part, for machines without it.)
    real = sandbox._isolation()
    monkeypatch.setattr(sandbox, "_isolation",
                        lambda: dataclasses.replace(real, memory_files_refused=False))
    size = 12_345_679  # a size no other segment on the machine has
    code = textwrap.dedent(
        f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        shm = libc.shmget(0, {size}, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
        address = libc.shmat(shm, None, 0)
        ctypes.memset(address, 1, {size})
        libc.shmdt(ctypes.c_void_p(address))
        print(shm)
        """
    )
    if not os.path.exists("/proc/sysvipc/shm"):
        pytest.skip("no System V shared memory on this kernel")
    if not run_python("pass", limits=FAST).ipc_isolated:  # the segment would stay: not made
        pytest.skip("this kernel/user cannot create an IPC namespace")
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    assert size not in _host_shm_sizes()


def test_an_isolation_probe_that_fails_once_is_tried_again(tmp_path):
    # The probes run once per process and their answer holds for its life: one failing once
    # (seen on a loaded machine) left every later run without that isolation.
    from areal_jax.rewards.sandbox import _probe

    marker = tmp_path / "failed once"

    def fails_the_first_time(scratch):
        if not marker.exists():
            marker.touch()
            raise OSError("passing condition")

    assert _probe(fails_the_first_time) and marker.exists()

    def always_fails(scratch):
        raise OSError("no such namespace")

    assert not _probe(always_fails)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=-1)
    assert SandboxLimits(timeout_s=2.5).cpu_seconds == 4
