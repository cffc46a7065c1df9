"""Endless, deterministic, resumable iteration over a dataset, one permutation per epoch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptIterator(Generic[T]):
    """Yields items forever; epoch ``e`` visits them in ``permutation(seed, e)`` order.

    ``state_dict()`` (epoch, index, seed, size) restored with ``load_state_dict`` makes the next
    item exactly the one the saved iterator would have returned.
    """

    def __init__(self, items: Sequence[T], seed: int = 0, shuffle: bool = True):
        if len(items) == 0:
            raise ValueError("cannot iterate over an empty dataset")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self._items)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> PromptIterator[T]:
        return self

    def __next__(self) -> T:
        if self.index >= len(self._items):
            self.epoch += 1
            self.index = 0
        item = self._items[int(self._epoch_order()[self.index])]
        self.index += 1
        return item

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "size": len(self._items),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; its seed replaces ours, its size must match the dataset."""
        for key in ("epoch", "index", "seed", "size"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(
                    f"iterator state: {key!r} must be a non-negative integer, "
                    f"got {state.get(key)!r}"
                )
        if state["size"] != len(self._items):
            raise ValueError(
                f"iterator state was saved for {state['size']} items, "
                f"this dataset has {len(self._items)}"
            )
        if state["index"] > state["size"]:
            raise ValueError(f"iterator state: index {state['index']} exceeds size {state['size']}")
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]
        self._order_epoch = -1
