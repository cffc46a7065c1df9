"""The workflow plug-in contract: what the server hands a workflow and what it must return.

A workflow turns one validated request (``RolloutTask``) into a ``TrajectoryGroup``, calling the
engine as often as it likes (multi-turn, tool use) and the scorer for rewards. The server builds
it once, ``cls(tokenizer=tokenizer, **workflow.options)``, and runs many requests concurrently,
so ``run`` must keep per-request state local. The returned group must have
``group_id == task.request_id`` and ``task.group_size`` trajectories, every trajectory with
``prompt_ids == task.prompt_ids``; tokens a workflow inserts itself (a tool's output, a second
user turn) go into ``output_ids`` with ``output_mask`` 0.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from areal_jax.trajectory import Trajectory, TrajectoryGroup
from rollout.engine import GenerationEngine, SamplingParams

INSERTED_TOKEN_VERSION = -1  # version recorded for tokens a workflow inserted (mask 0)


@dataclasses.dataclass(frozen=True)
class RolloutTask:
    """One validated rollout request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    group_size: int
    reward_name: str
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prompt_text: str = ""

    def sample_id(self, index: int) -> str:
        """Engine request id of sample ``index``."""
        return f"{self.request_id}/{index}"

    def sample_params(self, index: int) -> SamplingParams:
        """Sampling params of sample ``index``: a given seed becomes ``seed + index``."""
        if self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + index)


class RewardScorer(Protocol):
    """Scores a completion; ``areal_jax.rewards.RewardPool`` is the production one."""

    async def score(self, reward_name: str, completion: str, metadata: dict) -> float: ...


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that workflows use."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class Workflow(abc.ABC):
    """Base class of workflows; the module docstring states the contract."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @abc.abstractmethod
    async def run(
        self, task: RolloutTask, engine: GenerationEngine, scorer: RewardScorer
    ) -> TrajectoryGroup:
        """Produce the trajectory group of one request."""


async def sample_group(
    task: RolloutTask, sample: Callable[[int], Awaitable[Trajectory]]
) -> TrajectoryGroup:
    """Run ``sample(i)`` for every sample of ``task`` at once; one failure cancels the others."""
    async with asyncio.TaskGroup() as tg:
        jobs = [tg.create_task(sample(i)) for i in range(task.group_size)]
    return TrajectoryGroup(task.request_id, [job.result() for job in jobs])
