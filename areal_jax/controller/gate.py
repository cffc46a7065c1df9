"""The staleness gate: admit a new prompt group only while its data cannot become too stale.

With trainer version i, batch size B (prompt groups) and maximum staleness η, a group may be
submitted only while ``submitted < (i + η + 1) · B`` (AReaL, Fu et al. 2025), and only while
fewer than ``max_in_flight`` groups are being generated. Failed or rejected groups free their
slot; a group resubmitted after a server failure keeps the one it holds. The controller passes
the version the rollout servers serve (confirmed published), which lags the trainer's while a
publish is in flight: the bound then holds for the weights that actually generate.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StalenessGate:
    batch_size: int
    max_staleness: int
    max_in_flight: int
    submitted: int = 0  # N_r: groups submitted so far (finished + in flight)
    in_flight: int = 0

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")

    def capacity(self, version: int) -> int:
        """How many more groups may be submitted now at trainer ``version``."""
        by_staleness = (version + self.max_staleness + 1) * self.batch_size - self.submitted
        by_concurrency = self.max_in_flight - self.in_flight
        return max(0, min(by_staleness, by_concurrency))

    def can_submit(self, version: int) -> bool:
        return self.capacity(version) > 0

    def on_submit(self) -> None:
        self.submitted += 1
        self.in_flight += 1

    def on_finished(self) -> None:
        """A group came back complete; it still counts as submitted."""
        self.in_flight -= 1

    def on_failed(self) -> None:
        """A group was rejected or failed for good: it frees its slot entirely."""
        self.submitted -= 1
        self.in_flight -= 1

    def on_dropped(self) -> None:
        """A finished group was discarded before training; its slot is free again."""
        if self.submitted - self.in_flight < 1:
            raise ValueError("no finished group to drop")
        self.submitted -= 1

    def restore(self, version: int, pending: int = 0) -> None:
        """After a restart at ``version``: the trained groups plus ``pending`` re-submitted ones."""
        self.submitted = version * self.batch_size + pending
        self.in_flight = 0
