"""Single-turn verifiable-reward workflow: ``group_size`` answers to one prompt, each scored."""

from __future__ import annotations

from areal_jax.trajectory import Trajectory, TrajectoryGroup
from rollout.engine import GenerationEngine, GenerationResult
from rollout.workflows.base import RewardScorer, RolloutTask, Tokenizer, Workflow, sample_group


class SingleTurnWorkflow(Workflow):
    """Samples answers concurrently; the group is returned when every sample has finished.

    An answer's text is its tokens decoded without special tokens; the reward is the scorer's
    value for that text. Aborted answers (server shutdown) are not scored and get reward 0.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        super().__init__(tokenizer)
        self.skip_special_tokens = skip_special_tokens

    async def run(
        self, task: RolloutTask, engine: GenerationEngine, scorer: RewardScorer
    ) -> TrajectoryGroup:
        return await sample_group(task, lambda i: self._sample(task, i, engine, scorer))

    async def _sample(
        self, task: RolloutTask, index: int, engine: GenerationEngine, scorer: RewardScorer
    ) -> Trajectory:
        result = await engine.generate_full(
            list(task.prompt_ids), task.sample_params(index), task.sample_id(index)
        )
        reward = await score(self.tokenizer, scorer, task, result, self.skip_special_tokens)
        return Trajectory(
            prompt_ids=task.prompt_ids,
            output_ids=result.output_ids,
            behav_logprobs=result.logprobs,
            versions=result.versions,
            reward=reward,
            finish_reason=result.finish_reason,
        )


async def score(
    tokenizer: Tokenizer,
    scorer: RewardScorer,
    task: RolloutTask,
    result: GenerationResult,
    skip_special_tokens: bool = True,
) -> float:
    """Reward of a generated answer; 0 without scoring when it was aborted."""
    if result.finish_reason == "abort":
        return 0.0
    text = tokenizer.decode(result.output_ids, skip_special_tokens=skip_special_tokens)
    return float(await scorer.score(task.reward_name, text, dict(task.metadata)))
