"""Which training run a rollout server serves, so that a second run cannot take it over.

A trainer names its run on every call (the ``areal-run`` metadata, ``RUN_METADATA_KEY``). A
weights update that loads makes its run the server's: from then on a weights update from any
other client (another run, an evaluation, a call naming no run) is refused while the serving
run's trainer is around: a stream of it open (``Rollout``, ``Generate``), or a call from it in
the last ``lease_s`` seconds. A trainer that restarts names the same run and goes on. A run
done with the server says so (``Release``); one that just went away frees it ``lease_s`` after
it was last heard from. Generation itself is not restricted: it changes nothing the run relies
on. The lease lives in the server's memory: a restarted server serves no run.
"""

from __future__ import annotations

import collections
import math
import time

import grpc

from areal_jax.protocol.runs import MAX_RUN_ID_CHARS, RUN_METADATA_KEY, is_run_id


def run_of(context: grpc.aio.ServicerContext) -> str:
    """The run a call names ("" for none), or ``ValueError`` for a malformed name."""
    run = dict(context.invocation_metadata() or ()).get(RUN_METADATA_KEY, "")
    if not is_run_id(run) and run != "":
        raise ValueError(f"{RUN_METADATA_KEY} metadata: a run id is 1 to {MAX_RUN_ID_CHARS} "
                         "printable ASCII characters")
    return run


class RunLease:
    """The serving run, and when its trainer was last heard from (see the module docstring)."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s = lease_s
        self._clock = clock
        self.run = ""  # the run whose weights the server loaded last ("": none named)
        self._heard = -math.inf
        self._streams: collections.Counter[str] = collections.Counter()

    def heard(self, run: str) -> None:
        """A call from ``run`` arrived (or ended)."""
        if run and run == self.run:
            self._heard = self._clock()

    def stream_opened(self, run: str) -> None:
        """A stream of ``run`` opened: its trainer counts as around until it closes."""
        self._streams[run] += 1
        self.heard(run)

    def stream_closed(self, run: str) -> None:
        """A stream of ``run`` closed (its lease runs from now once none is open)."""
        self._streams[run] -= 1
        if not self._streams[run]:
            del self._streams[run]
        self.heard(run)

    def idle_s(self) -> float:
        """Seconds since the serving run's trainer was last heard from (0 while a stream of
        it is open; infinite with no serving run)."""
        if not self.run:
            return math.inf
        if self._streams[self.run]:
            return 0.0
        return self._clock() - self._heard

    def refusal(self, run: str) -> str | None:
        """Why ``run`` may not load weights now, or None."""
        if not self.run or run == self.run or self.idle_s() >= self.lease_s:
            return None
        heard = ("has a stream open" if self.idle_s() == 0
                 else f"was heard from {self.idle_s():.0f} s ago")
        asker = f"run {run!r}" if run else "a client naming no run"
        return (f"this server serves run {self.run!r}, whose trainer {heard}: {asker} may load "
                f"weights once that trainer has been gone run_lease_s ({self.lease_s:g} s); "
                "point this run at other servers, or stop the other run first")

    def loaded(self, run: str) -> None:
        """Weights named by ``run`` loaded: the server serves that run now."""
        self.run = run
        self._heard = self._clock()

    def release(self, run: str) -> None:
        """``run`` is done with the server: whoever asks next may load (the weights stay)."""
        if run and run == self.run:
            self.run = ""
