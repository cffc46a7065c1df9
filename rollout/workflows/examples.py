"""Example of a custom multi-call workflow: answer, get asked to check, answer again.

Select it with ``workflow.path=rollout.workflows.examples.CheckYourAnswerWorkflow``. Each sample
is one trajectory: first answer, then the inserted "check" turn (``output_mask`` 0, log-prob 0,
version ``INSERTED_TOKEN_VERSION``), then the revised answer, which alone is scored. The two
answers share the request's ``max_new_tokens`` budget, inserted tokens included.
"""

from __future__ import annotations

import dataclasses

from areal_jax.trajectory import Trajectory, TrajectoryGroup
from rollout.engine import GenerationEngine, GenerationResult
from rollout.workflows.base import (
    INSERTED_TOKEN_VERSION,
    RewardScorer,
    RolloutTask,
    Tokenizer,
    Workflow,
    sample_group,
)
from rollout.workflows.single_turn import score

DEFAULT_CHECK_TEXT = "\nPlease check your answer and give the final answer again.\n"


class CheckYourAnswerWorkflow(Workflow):
    """Two generation turns per sample with a user turn inserted between them."""

    def __init__(self, tokenizer: Tokenizer, check_text: str = DEFAULT_CHECK_TEXT):
        super().__init__(tokenizer)
        self.check_ids = list(tokenizer.encode(check_text, add_special_tokens=False))
        if not self.check_ids:
            raise ValueError("check_text encodes to no tokens")

    async def run(
        self, task: RolloutTask, engine: GenerationEngine, scorer: RewardScorer
    ) -> TrajectoryGroup:
        return await sample_group(task, lambda i: self._sample(task, i, engine, scorer))

    async def _sample(
        self, task: RolloutTask, index: int, engine: GenerationEngine, scorer: RewardScorer
    ) -> Trajectory:
        params = task.sample_params(index)
        first = await engine.generate_full(list(task.prompt_ids), params, task.sample_id(index))
        budget = params.max_new_tokens - len(first.output_ids) - len(self.check_ids)
        if first.finish_reason != "stop" or budget < 1:
            reward = await score(self.tokenizer, scorer, task, first)
            return _trajectory(task, [(first, 1)], first.finish_reason, reward)
        inserted = GenerationResult(
            self.check_ids,
            [0.0] * len(self.check_ids),
            [INSERTED_TOKEN_VERSION] * len(self.check_ids),
            "stop",
        )
        second = await engine.generate_full(
            list(task.prompt_ids) + first.output_ids + self.check_ids,
            dataclasses.replace(params, max_new_tokens=budget),
            f"{task.sample_id(index)}/check",
        )
        reward = await score(self.tokenizer, scorer, task, second)
        parts = [(first, 1), (inserted, 0), (second, 1)]
        return _trajectory(task, parts, second.finish_reason, reward)


def _trajectory(
    task: RolloutTask,
    parts: list[tuple[GenerationResult, int]],
    finish_reason: str,
    reward: float,
) -> Trajectory:
    """Concatenate generated (mask 1) and inserted (mask 0) segments into one trajectory."""
    return Trajectory(
        prompt_ids=task.prompt_ids,
        output_ids=[t for part, _ in parts for t in part.output_ids],
        behav_logprobs=[lp for part, _ in parts for lp in part.logprobs],
        versions=[v for part, _ in parts for v in part.versions],
        output_mask=[mask for part, mask in parts for _ in part.output_ids],
        reward=reward,
        finish_reason=finish_reason,
    )
