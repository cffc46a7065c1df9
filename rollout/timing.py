"""Per-group timing and server throughput, measured around the engine and the scorer.

The server hands each workflow run an engine and a scorer wrapped here, so every workflow
(plug-ins included) reports generation and reward time without timing code of its own.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

from rollout.engine import (
    GenerationChunk,
    GenerationEngine,
    GenerationResult,
    SamplingParams,
    collect,
)
from rollout.workflows.base import RewardScorer


class ActivityClock:
    """Wall-clock seconds during which at least one tracked activity was running."""

    def __init__(self):
        self.total = 0.0
        self._active = 0
        self._since = 0.0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self._active == 0:
            self._since = time.monotonic()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.total += time.monotonic() - self._since


class ThroughputMeter:
    """Tokens counted in total and per second over a sliding window."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.total = 0
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._started = time.monotonic()

    def add(self, n: int) -> None:
        if n:
            self.total += n
            self._events.append((time.monotonic(), n))

    def rate(self) -> float:
        now = time.monotonic()
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        span = min(self.window_s, max(now - self._started, 1e-9))
        return sum(n for _, n in self._events) / span


class TimedEngine:
    """An engine view that times generation on ``clock`` and reports token counts."""

    def __init__(
        self, engine: GenerationEngine, clock: ActivityClock, on_tokens: Callable[[int], None]
    ):
        self._engine = engine
        self._clock = clock
        self._on_tokens = on_tokens

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        chunks = self._engine.generate(prompt_ids, params, request_id)
        with self._clock.track():
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self._on_tokens(len(chunk.token_ids))
                    yield chunk

    async def generate_full(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> GenerationResult:
        return await collect(self.generate(prompt_ids, params, request_id))


class TimedScorer:
    """A scorer view for one group: times scoring on ``clock``, counts its ``calls`` and keeps,
    in ``failures``, what went wrong in each call that failed and scored 0 (where the scorer
    tells, with ``score_with_error`` as ``RewardPool`` does)."""

    def __init__(self, scorer: RewardScorer, clock: ActivityClock):
        self._scorer = scorer
        self._clock = clock
        self.calls = 0
        self.failures: list[str] = []

    async def score(self, reward_name: str, completion: str, metadata: dict) -> float:
        self.calls += 1
        checked = getattr(self._scorer, "score_with_error", None)
        with self._clock.track():
            if checked is None:
                return await self._scorer.score(reward_name, completion, metadata)
            value, error = await checked(reward_name, completion, metadata)
        if error is not None:
            self.failures.append(error)
        return value
