"""Rewards: a registry of ``fn(completion, metadata) -> float`` and a process pool to run them."""

from areal_jax.rewards.pool import RewardPool
from areal_jax.rewards.registry import (
    RewardConfigError,
    RewardFn,
    RewardNotFoundError,
    available_rewards,
    check_reward,
    get_reward,
    register_reward,
)

__all__ = [
    "RewardConfigError",
    "RewardFn",
    "RewardNotFoundError",
    "RewardPool",
    "available_rewards",
    "check_reward",
    "get_reward",
    "register_reward",
]
