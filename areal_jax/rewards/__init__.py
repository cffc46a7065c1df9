"""Rewards: a registry of ``fn(completion, metadata) -> float`` and a process pool to run them."""

from areal_jax.rewards.pool import RewardPool
from areal_jax.rewards.registry import (
    RewardFn,
    RewardNotFoundError,
    available_rewards,
    get_reward,
    register_reward,
)

__all__ = [
    "RewardFn",
    "RewardNotFoundError",
    "RewardPool",
    "available_rewards",
    "get_reward",
    "register_reward",
]
