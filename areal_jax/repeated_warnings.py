"""Warnings of a kind that may repeat for a whole run (a reward failing on some answers, prompts
rejected as too long): the first few are logged in full, the rest counted and the count logged
at most once a minute, so a failure that keeps happening stays visible without flooding a log."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

SHOWN_PER_KIND = 5  # warnings of one kind logged in full
MAX_KINDS = 20  # kinds told apart; warnings of further kinds share one
OTHER_KINDS = "warnings of other kinds"
COUNT_EVERY_S = 60.0  # the count of those held back is logged at most this often, per kind


class RepeatedWarnings:
    """Logs warnings (or messages of another ``level``) through ``logger``, each with a
    ``kind`` (what repeats: e.g. "failures of reward math"): the first ``shown_per_kind`` of a
    kind in full, then a count of the ones held back whenever ``count_every_s`` have passed
    since the last full or counted line of that kind, and at :meth:`flush`."""

    def __init__(self, logger: logging.Logger, shown_per_kind: int = SHOWN_PER_KIND,
                 count_every_s: float = COUNT_EVERY_S, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic):
        if shown_per_kind < 1:
            raise ValueError(f"shown_per_kind must be >= 1, got {shown_per_kind}")
        self._log, self._shown_per_kind, self._every = logger, shown_per_kind, count_every_s
        self._level = level
        self._clock = clock
        self._seen: collections.Counter[str] = collections.Counter()
        self._held: collections.Counter[str] = collections.Counter()
        self._last: dict[str, float] = {}  # when a line of the kind was last logged

    def warn(self, kind: str, message: str, *args, exc_info=None) -> None:
        """Log ``message % args`` (with ``exc_info``'s traceback) as a warning of ``kind``, or
        count it. Past ``MAX_KINDS`` kinds, a new kind is one of ``OTHER_KINDS``."""
        if kind not in self._seen and len(self._seen) >= MAX_KINDS:
            kind = OTHER_KINDS
        self._seen[kind] += 1
        seen = self._seen[kind]
        if seen <= self._shown_per_kind:
            if seen == self._shown_per_kind:
                message += " (further %s are counted, every %g s at most)"
                args = (*args, kind, self._every)
            self._log.log(self._level, message, *args, exc_info=exc_info)
            self._last[kind] = self._clock()
            return
        self._held[kind] += 1
        if self._clock() - self._last[kind] >= self._every:
            self._say_held(kind)

    def flush(self) -> None:
        """Log the count of every kind's warnings held back since its last line."""
        for kind in list(self._held):
            self._say_held(kind)

    def _say_held(self, kind: str) -> None:
        held = self._held.pop(kind, 0)
        if held:
            self._log.log(self._level, "%d more %s (%d in all)", held, kind, self._seen[kind])
            self._last[kind] = self._clock()
