"""Held-out accuracy of the policy the rollout servers serve now."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from areal_jax.controller.requests import rollout_request
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.data.dataset import PromptItem

_rounds = itertools.count()


async def evaluate(pool: RolloutPool, items: list[PromptItem], reward: str, *,
                   max_new_tokens: int, temperature: float = 0.0) -> dict[str, float]:
    """Mean reward (accuracy for 0/1 rewards) and response length, one sample per prompt."""
    tag = next(_rounds)
    futures = [
        pool.submit(rollout_request(item, f"eval-{tag}-{i}", reward, 1, max_new_tokens,
                                    temperature, seed=i))
        for i, item in enumerate(items)
    ]
    groups = await asyncio.gather(*futures)
    rewards, lengths, failed = [], [], 0
    for group in groups:
        if group.HasField("error"):
            failed += 1
            continue
        for t in group.trajectories:
            rewards.append(t.reward)
            lengths.append(len(t.output_ids))
    return {
        "eval/accuracy": float(np.mean(rewards)) if rewards else float("nan"),
        "eval/response_length": float(np.mean(lengths)) if lengths else float("nan"),
        "eval/num_prompts": float(len(rewards)),
        "eval/failed": float(failed),
    }
