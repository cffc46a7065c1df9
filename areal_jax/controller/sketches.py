"""Sketches of a run's first batches, so the trainer compiles their shapes before they come.

A step's programs depend on the shapes its batch packs into, which depend on how long the
responses are; a new shape compiles inside the step, on the critical path of the loop. Before
the first batch the trainer idles (rollout servers start, the held-out set is evaluated), so
the controller hands it plausible batches to compile for meanwhile: prompts drawn from the
training data, each answered ``group_size`` times with response lengths spread around a guessed
mean, short guesses first (the first batches gather the groups that finished first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Guessed mean response lengths, as fractions of max_new_tokens, in the order compiled.
RESPONSE_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)


def first_batch_sketches(
    prompt_lengths: Sequence[int],
    batch_size: int,
    group_size: int,
    max_new_tokens: int,
    seed: int = 0,
) -> list[list[int]]:
    """Token counts (prompt + response) of one plausible batch per guessed mean response
    length m (``RESPONSE_FRACTIONS`` of ``max_new_tokens``): ``batch_size`` prompts drawn from
    ``prompt_lengths``, each answered ``group_size`` times with lengths uniform in
    [1, min(2 m, max_new_tokens)]. Deterministic in ``seed``."""
    if len(prompt_lengths) == 0:
        raise ValueError("prompt_lengths is empty: no prompt to sketch a batch from")
    rng = np.random.default_rng(seed)
    sketches = []
    for fraction in RESPONSE_FRACTIONS:
        top = min(max_new_tokens, max(1, round(2 * fraction * max_new_tokens)))
        prompts = rng.choice(np.asarray(prompt_lengths), size=batch_size)
        responses = rng.integers(1, top + 1, size=(batch_size, group_size))
        sketches.append([int(p + r) for p, row in zip(prompts, responses) for r in row])
    return sketches
