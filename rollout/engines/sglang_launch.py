"""Starting, watching and stopping an SGLang server process."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from areal_jax.processes import tied_argv
from rollout.engine import EngineError
from rollout.engines import sglang_api as api
from rollout.engines.http_json import JsonHttpClient

log = logging.getLogger(__name__)


# Settings of SGLang's environment that change what its answers mean to the trainer:
# SGLANG_RETURN_ORIGINAL_LOGPROB returns log_softmax(logits) before the temperature, not the
# log-probs of the distribution sampled from (RL stacks often export it).
CHANGES_LOGPROBS = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)


def launch_environment() -> dict[str, str]:
    """This process's environment for an SGLang it launches, less ``CHANGES_LOGPROBS`` (a
    warning names each one set)."""
    env = dict(os.environ)
    for name in CHANGES_LOGPROBS:
        if env.pop(name, None) is not None:
            log.warning("%s is set: not passed to the SGLang launched (it would return log-probs "
                        "before the temperature, and the trainer would weight tokens by them)",
                        name)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangProcess:
    """An SGLang server in its own process group, its output in ``log_path``.

    On Linux it dies with the process that started it, even one that was SIGKILLed: call
    ``start`` from a thread that lives as long as that process (the event loop's), since the
    kernel signals the child when the starting thread ends.
    """

    def __init__(self, argv: list[str], log_path: Path):
        self.argv = argv
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                tied_argv(self.argv, signal.SIGKILL),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=launch_environment(),
                start_new_session=True,
            )
        log.info("started SGLang (pid %d), log in %s", self._proc.pid, self.log_path)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def exit_code(self) -> int | None:
        """None while running."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            with self.log_path.open(errors="replace") as f:
                return "".join(collections.deque(f, maxlen=lines))
        except OSError:
            return ""

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``."""
        if self._proc is None or self._proc.poll() is not None:
            return
        pgid = self._proc.pid  # start_new_session made it the group leader
        os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.to_thread(self._proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            await asyncio.to_thread(self._proc.wait)


async def wait_ready(
    client: JsonHttpClient,
    process: SGLangProcess | None,
    timeout_s: float,
    poll_s: float = 0.5,
) -> None:
    """Poll ``GET /health_generate`` until 200; fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and (code := process.exit_code()) is not None:
            raise EngineError(
                f"SGLang exited with code {code} while starting; last log lines:\n"
                f"{process.log_tail()}"
            )
        try:
            status, _ = await client.request("GET", api.HEALTH, timeout_s=10.0)
            if status == 200:
                return
            last = f"HTTP {status}"
        except EngineError as e:
            last = str(e)
        await asyncio.sleep(poll_s)
    raise EngineError(f"SGLang at {client.base_url} not ready after {timeout_s:.0f} s ({last})")
