"""The sandbox's filesystem jail: model code cannot read the run's files or leave the jail."""

import ast
import json
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from areal_jax.rewards.code_tests import code_reward
from areal_jax.rewards.sandbox import SandboxLimits, filesystem_isolation_available, run_python

FAST = SandboxLimits(timeout_s=5.0)

pytestmark = pytest.mark.skipif(
    not filesystem_isolation_available(),
    reason="no filesystem jail here (needs root and mount namespaces)",
)


@pytest.fixture
def run_dir(monkeypatch):
    """A world-readable run directory (the usual umask) holding the dataset's answers; the cwd."""
    root = Path(tempfile.mkdtemp(prefix="areal-run-"))
    root.chmod(0o755)
    (root / "notes.txt").write_text("SECRET-IN-CWD")
    (root / "data").mkdir(mode=0o755)
    answers = root / "data" / "answers.jsonl"
    answers.write_text(json.dumps({"question": "2+2", "answer": "SECRET-ANSWER"}) + "\n")
    for f in (root / "notes.txt", answers):
        f.chmod(0o644)
    monkeypatch.chdir(root)
    yield root
    shutil.rmtree(root)


def _snoop(run_dir: Path) -> str:
    """A solution printing whatever it can read of the run's files, else ``hidden``."""
    targets = [
        "notes.txt",
        "../notes.txt",
        str(run_dir / "notes.txt"),
        str(run_dir / "data" / "answers.jsonl"),
        "/proc/self/cwd/notes.txt",
        f"/proc/{os.getpid()}/cwd/notes.txt",
    ]
    return textwrap.dedent(
        f"""
        import os
        leaks = []
        for path in {targets!r}:
            try:
                leaks.append(open(path).read())
            except OSError:
                pass
        for d in ({str(run_dir)!r}, "/proc", {os.path.dirname(str(run_dir))!r}):
            try:
                leaks.extend(os.listdir(d))
            except OSError:
                pass
        print("LEAK " + repr(leaks) if leaks else "hidden")
        """
    )


def test_solution_cannot_read_the_callers_cwd_or_the_answers_file(run_dir):
    result = run_python(_snoop(run_dir), limits=FAST)
    assert result.fs_isolated and result.ok, result.stderr
    assert result.stdout.strip() == "hidden"
    completion = f"```python\n{_snoop(run_dir)}```"
    assert code_reward(completion, {"tests": [{"input": "", "output": "hidden"}]}) == 1.0


def test_jail_shows_only_system_dirs_and_cannot_be_left_or_changed():
    code = textwrap.dedent(
        """
        import os
        print(sorted(os.listdir("/")))
        print(os.getcwd(), sorted(os.listdir(".")))
        for attempt in (lambda: os.chroot("/tmp"), lambda: open("/usr/evil", "w"),
                        lambda: os.mkdir("/evil")):
            try:
                attempt()
                print("allowed")
            except OSError as e:
                print(type(e).__name__)
        open("/tmp/scratch", "w").write("ok")  # a private /tmp is writable
        print(open("/tmp/scratch").read())
        """
    )
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    top, cwd, *attempts, scratch = result.stdout.splitlines()
    top = set(ast.literal_eval(top))
    assert {"usr", "dev", "tmp", "sandbox"} <= top
    assert not top & {"etc", "proc", "sys", "var", "run"}
    assert cwd == "/sandbox ['main.py']"
    assert attempts == ["PermissionError", "OSError", "PermissionError"]
    assert scratch == "ok"


def test_an_interpreter_prefix_does_not_expose_its_other_files():
    home = Path(tempfile.mkdtemp(prefix="areal-home-"))  # e.g. ~/bin/python3 -> ~ is the prefix
    try:
        home.chmod(0o755)
        (home / "bin").mkdir(mode=0o755)
        (home / "bin" / "python3").symlink_to(os.path.realpath(sys.executable))
        (home / "secret.txt").write_text("SECRET-IN-HOME")
        (home / "secret.txt").chmod(0o644)
        code = f"import os\nprint(os.path.exists({str(home / 'secret.txt')!r}))"
        limits = SandboxLimits(timeout_s=5.0, python=str(home / "bin" / "python3"))
        result = run_python(code, limits=limits)
        assert result.ok, result.stderr
        assert result.stdout.strip() == "False"
    finally:
        shutil.rmtree(home)
