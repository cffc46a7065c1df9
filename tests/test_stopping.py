"""SIGTERM as a graceful stop: the main task is cancelled, its cleanup runs to the end."""

import asyncio
import os
import signal
import time

import pytest

from areal_jax.stopping import run_stoppable, stop_on_sigterm


@pytest.fixture
def sigterm_stops():
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_cancels_the_main_task_and_a_second_one_spares_its_cleanup(sigterm_stops):
    # A second SIGTERM cancelled the unwinding too (servers being stopped, checkpoint writes).
    steps = []

    async def work():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
            steps.append("not cancelled")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.2)
            steps.append("cleaned up")

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_stoppable(work())
    assert steps == ["cleaned up"] and time.monotonic() - began < 10
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # still a graceful stop


def test_outside_the_loop_sigterm_raises_keyboard_interrupt_where_the_code_is(sigterm_stops):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert run_stoppable(asyncio.sleep(0, result=7)) == 7


def test_a_sigterm_while_the_local_servers_stop_at_the_end_is_a_stop(sigterm_stops, monkeypatch):
    # The servers were stopped on the event loop's thread: a SIGTERM meanwhile was never
    # handled, and the run ended with exit code 0 as if nothing had been asked.
    from types import SimpleNamespace

    from areal_jax.controller import servers

    class Servers:
        addresses = ["127.0.0.1:1"]

        def stop(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # a server taking its time to shut down

    class Pool:
        async def close(self):
            pass

    async def ready(*args):
        pass

    monkeypatch.setattr(servers, "launch_local", lambda *args: Servers())
    monkeypatch.setattr(servers, "make_pool", lambda *args, **kwargs: Pool())
    monkeypatch.setattr(servers, "wait_ready", ready)
    cfg = SimpleNamespace(rollout=SimpleNamespace(start_timeout_s=1, addresses=[],
                                                  addresses_file=None))

    async def run():
        async with servers.rollout_servers(cfg, None, 0):
            pass
        return "finished"

    with pytest.raises(KeyboardInterrupt):
        run_stoppable(run())
