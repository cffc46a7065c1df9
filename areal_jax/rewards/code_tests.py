"""Code reward: run the completion's Python against the problem's tests in the sandbox.

``metadata["tests"]`` is either a list of ``{"input": stdin, "output": expected stdout}`` cases
(a JSON string of such a list is accepted too) or a string of assert-based Python test code run
after the solution, in its namespace, which must run to its end (a solution that ends the
process early, with any status, fails) and exit with status 0. Outputs are compared line by line with
trailing whitespace ignored. Optional ``metadata["timeout_s"]`` and ``metadata["memory_mb"]`` set
the per-test wall-clock and memory limits (defaults: ``SandboxLimits``; at most
``MAX_TEST_TIMEOUT_S`` and ``MAX_TEST_MEMORY_MB``, since metadata may come from a client), and
a problem has at most ``MAX_TEST_CASES`` cases, and a string ``tests`` at most
``MAX_TESTS_CHARS`` characters; ``time_budget_s`` tells the reward pool how long a call may take
with them. The solution is the last fenced code block of
the completion (```python ... ``` preferred), or the whole completion when it has no fence.
"""

from __future__ import annotations

import collections
import json
import re
import secrets

from areal_jax.rewards.sandbox import SandboxLimits, run_python

RUN_OVERHEAD_S = 1.0  # interpreter start-up and clean-up of one sandbox run, beyond its timeout
# Ceilings on what a problem's metadata may ask for: it travels with requests from clients, so
# it must not be able to hold a reward worker for hours or lift the sandbox's memory limit.
MAX_TEST_TIMEOUT_S = 60.0
MAX_TEST_MEMORY_MB = 8192
MAX_TEST_CASES = 512
# A string ``tests`` is decoded on the rollout server's event loop to size a call's time limit;
# JSON decodes to many times its size, so its length is bounded as well.
MAX_TESTS_CHARS = 8 << 20
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
# Assert-style tests pass when they run to their end: the harness prints a token it read from
# stdin (not in the program's text) after the last assert, so a solution that ends the process
# early with status 0 (``exit(0)``, ``os._exit(0)``) passes nothing. The harness holds on to
# what it calls (a solution replacing ``builtins.exec`` skipped the tests), and its stdin, once
# read, becomes /dev/null (the token could be read from it again).
_ASSERT_HARNESS = """import os as _os, sys as _sys
def _run(_code, _tests, _exec=exec, _compile=compile, _write=_os.write,
         _flush=_sys.stdout.flush):
    _token = _os.read(0, 64)
    _os.dup2(_os.open(_os.devnull, _os.O_RDONLY), 0)
    _namespace = {{"__name__": "__main__"}}
    _exec(_compile(_code, "<solution>", "exec"), _namespace)
    _exec(_compile(_tests, "<tests>", "exec"), _namespace)
    _flush()
    _write(1, b"\\n" + _token + b"\\n")
_run({code!r}, {tests!r})
"""


def extract_code(completion: str) -> str:
    """The last ```python block, else the last fenced block, else the completion itself."""
    blocks = _FENCE.findall(completion)
    python_blocks = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def parse_tests(tests) -> list[dict] | str:
    """Normalise ``metadata["tests"]`` to a list of I/O cases or a string of test code."""
    if isinstance(tests, str):
        if len(tests) > MAX_TESTS_CHARS:
            raise ValueError(f"metadata 'tests': {len(tests)} characters, at most "
                             f"{MAX_TESTS_CHARS}")
        stripped = tests.strip()
        if stripped.startswith("["):
            try:
                decoded = json.loads(stripped)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, list):
                return parse_tests(decoded)
        if not stripped:
            raise ValueError("metadata 'tests' is an empty string")
        return tests
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(
            f"metadata 'tests' must be a non-empty list or a string, got {tests!r:.80}"
        )
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"metadata 'tests'[{i}] must be a mapping with 'input' and 'output'")
    return list(tests)


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(actual) == lines(str(expected))


def run_tests(
    code: str, tests, limits: SandboxLimits | None = None, stop_at_first_failure: bool = False
) -> tuple[int, int]:
    """(passed, total) for ``code`` against ``tests``; a test-code string counts as one test."""
    tests = parse_tests(tests)
    _check_case_count(tests)
    if isinstance(tests, str):
        token = secrets.token_hex(16)
        result = run_python(_ASSERT_HARNESS.format(code=code, tests=tests), stdin=token,
                            limits=limits)
        ran_to_the_end = token in result.stdout
        return int(result.ok and ran_to_the_end), 1
    passed = 0
    for case in tests:
        result = run_python(code, stdin=str(case["input"]), limits=limits)
        ok = result.ok and _same_output(result.stdout, case["output"])
        passed += ok
        if not ok and stop_at_first_failure:
            break
    return passed, len(tests)


def _check_case_count(tests) -> None:
    if not isinstance(tests, str) and len(tests) > MAX_TEST_CASES:
        raise ValueError(f"metadata 'tests': {len(tests)} cases, at most {MAX_TEST_CASES}")


def _bounded(metadata: dict, key: str, cast, ceiling) -> int | float:
    """``metadata[key]`` as a number in (0, ceiling]; ValueError naming the key otherwise."""
    value = cast(metadata[key])
    if not 0 < value <= ceiling:  # also rejects NaN
        raise ValueError(f"metadata {key!r}: must be in (0, {ceiling}], got {metadata[key]!r}")
    return value


def limits_from_metadata(metadata: dict) -> SandboxLimits:
    """Sandbox limits with the problem's own ``timeout_s`` / ``memory_mb`` where given (each
    within its ceiling, else ValueError)."""
    overrides = {}
    if "timeout_s" in metadata:
        overrides["timeout_s"] = _bounded(metadata, "timeout_s", float, MAX_TEST_TIMEOUT_S)
    if "memory_mb" in metadata:
        overrides["memory_bytes"] = _bounded(metadata, "memory_mb", int, MAX_TEST_MEMORY_MB) << 20
    return SandboxLimits(**overrides)


def _sandbox_runs(tests) -> int:
    tests = parse_tests(tests)
    _check_case_count(tests)
    return 1 if isinstance(tests, str) else len(tests)


# The samples of a group share their metadata, and are scored as each ends, interleaved with
# other groups': a ``tests`` string is decoded once, not once per sample. Keyed by the string's
# hash and length (a string caches its hash), so entries hold no string, only its outcome.
_RUNS_OF_TEXT: collections.OrderedDict[tuple[int, int], int | ValueError] = (
    collections.OrderedDict())
_RUNS_OF_TEXT_ENTRIES = 1024


def _sandbox_runs_of_text(tests: str) -> int:
    key = (hash(tests), len(tests))
    if key in _RUNS_OF_TEXT:
        _RUNS_OF_TEXT.move_to_end(key)
    else:
        try:
            _RUNS_OF_TEXT[key] = _sandbox_runs(tests)
        except ValueError as e:  # a bad string is not decoded again either
            _RUNS_OF_TEXT[key] = e
        if len(_RUNS_OF_TEXT) > _RUNS_OF_TEXT_ENTRIES:
            _RUNS_OF_TEXT.popitem(last=False)
    runs = _RUNS_OF_TEXT[key]
    if isinstance(runs, ValueError):
        raise ValueError(str(runs))
    return runs


def time_budget_s(metadata: dict) -> float:
    """Longest legitimate time of one call: sandbox runs × (per-test timeout + start-up)."""
    tests = metadata["tests"]
    runs = _sandbox_runs_of_text(tests) if isinstance(tests, str) else _sandbox_runs(tests)
    return runs * (limits_from_metadata(metadata).timeout_s + RUN_OVERHEAD_S)


def _score(completion: str, metadata: dict, all_or_nothing: bool) -> float:
    if "tests" not in metadata:
        raise KeyError("code reward needs metadata 'tests'")
    passed, total = run_tests(
        extract_code(completion),
        metadata["tests"],
        limits=limits_from_metadata(metadata),
        stop_at_first_failure=all_or_nothing,
    )
    if all_or_nothing:
        return 1.0 if passed == total else 0.0
    return passed / total


def code_reward(completion: str, metadata: dict) -> float:
    """1.0 when every test passes, else 0.0 (stops at the first failing case)."""
    return _score(completion, metadata, all_or_nothing=True)


def code_fraction_reward(completion: str, metadata: dict) -> float:
    """Fraction of tests passed."""
    return _score(completion, metadata, all_or_nothing=False)


code_reward.time_budget_s = time_budget_s
code_fraction_reward.time_budget_s = time_budget_s
