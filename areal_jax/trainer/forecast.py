"""Which micro-batch shapes the next training steps will likely need, so they compile ahead.

A step's programs depend on the shapes (R, T) its batch packs into, and a shape met for the
first time compiles inside the step, on the loop's critical path. Compiling ahead only pays if
the likely shapes go first, and which are likely depends on the run's length distribution and
on the shapes already compiled (packing prefers them). ``ShapeForecast`` estimates it by
resampling: it draws batches from the trajectory lengths seen so far (whole groups, as they
come; a bootstrap), packs each as the trainer would given the shapes it knows, and ranks the
new shapes by how many of the drawn batches need them.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence

import numpy as np

from areal_jax.rl import MicroBatchConfig
from areal_jax.trainer.batches import minibatch_shapes


class ShapeForecast:
    """Bootstrap forecast of the new micro-batch shapes of coming training batches."""

    def __init__(self, n_minibatches: int, micro_batch: MicroBatchConfig, samples: int = 32,
                 keep_groups: int = 512, prior_until: int = 32, seed: int = 0):
        """``samples``: batches drawn per forecast; ``keep_groups``: the most recent groups
        drawn from; ``prior_until``: the lengths given to ``set_prior`` are drawn from too
        until this many trained groups have been seen."""
        if samples < 1 or keep_groups < 1 or prior_until < 0:
            raise ValueError(f"samples ({samples}) and keep_groups ({keep_groups}) must be >= 1 "
                             f"and prior_until ({prior_until}) >= 0")
        self._n_minibatches = n_minibatches
        self._cfg = micro_batch
        self._samples = samples
        self._prior_until = prior_until
        self._groups: collections.deque[tuple[int, ...]] = collections.deque(maxlen=keep_groups)
        self._seen = 0
        self._prior: list[tuple[int, ...]] = []
        self._rng = np.random.default_rng(seed)

    def set_prior(self, lengths: Sequence[int]) -> None:
        """Token counts (prompt + response) of trajectories like those to come, e.g. the
        held-out evaluation's, each drawn on its own until enough groups were trained on."""
        self._prior = [(int(n),) for n in lengths if n >= 2]  # a shorter one is no trajectory

    def observe(self, groups: Sequence[Sequence[int]]) -> None:
        """Record a trained batch: the token counts of each group's trajectories."""
        for lengths in groups:
            if lengths:
                self._groups.append(tuple(int(n) for n in lengths))
                self._seen += 1

    def rank(self, n_trajectories: int, known: Collection[tuple[int, int]]
             ) -> list[tuple[int, int]]:
        """Shapes not in ``known`` that a batch of ``n_trajectories`` would pack into, most
        often needed first (ties in (R, T) order); empty with nothing to draw from."""
        units = list(self._groups)
        if self._seen < self._prior_until:
            units += self._prior
        if not units or n_trajectories < self._n_minibatches:
            return []
        known = set(known)
        counts: collections.Counter[tuple[int, int]] = collections.Counter()
        for _ in range(self._samples):
            lengths: list[int] = []
            while len(lengths) < n_trajectories:
                lengths.extend(units[self._rng.integers(len(units))])
            lengths = lengths[:n_trajectories]
            order = self._rng.permutation(n_trajectories)
            try:
                shapes = minibatch_shapes(lengths, self._n_minibatches, self._cfg, order, known)
            except ValueError:  # a draw the packing refuses (e.g. over a fixed-mode budget)
                continue
            counts.update(set(shapes) - known)
        return sorted(counts, key=lambda s: (-counts[s], s))
