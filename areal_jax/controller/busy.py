"""How busy the controller keeps each rollout server: the measure of "generation never waits".

A server's busy fraction over a window is the time-average of the groups in flight on it
(generating or queued there) divided by its share of ``schedule.max_in_flight``, capped at 1:
1.0 means every slot the controller may fill was filled the whole time; a server that drains
while the trainer trains, or whose finished groups are not replaced at once, scores below 1.
When the staleness gate binds (the trainer is the bottleneck) the fraction drops by design.
"""

from __future__ import annotations

import time


class BusyClock:
    """The integral over time of the number of outstanding work items (item-seconds)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._count = 0
        self._since = clock()
        self._integral = 0.0

    def _advance(self) -> None:
        now = self._clock()
        self._integral += self._count * (now - self._since)
        self._since = now

    def add(self, n: int = 1) -> None:
        self._advance()
        self._count += n

    def remove(self, n: int = 1) -> None:
        if n > self._count:
            raise ValueError(f"removing {n} work items, only {self._count} outstanding")
        self._advance()
        self._count -= n

    def clear(self) -> None:
        """Nothing outstanding any more (the server died and its work went elsewhere)."""
        self.remove(self._count)

    @property
    def count(self) -> int:
        return self._count

    def item_seconds(self) -> float:
        """Item-seconds so far, including the interval still open."""
        self._advance()
        return self._integral


class BusyWindow:
    """Busy fraction of each clock since the previous ``fractions()`` call."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._last: dict[str, tuple[float, float]] = {}

    def fractions(self, clocks: dict[str, BusyClock], capacity: float) -> dict[str, float]:
        """``{name: mean outstanding items / capacity}`` over the window, in [0, 1]."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        now = self._clock()
        out = {}
        for name, busy in clocks.items():
            integral = busy.item_seconds()
            then, before = self._last.get(name, (None, 0.0))
            self._last[name] = (now, integral)
            if then is not None and now > then:
                out[name] = min(1.0, max(0.0, (integral - before) / (now - then) / capacity))
        return out
