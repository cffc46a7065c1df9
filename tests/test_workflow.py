"""Workflows: the single-turn verifiable-reward workflow, the plug-in loader and its example."""

import asyncio

import numpy as np
import pytest
from _rollout_fakes import (
    EOS_ID,
    ArithmeticEngine,
    ExactAnswerScorer,
    encode,
    make_tokenizer_dir,
    until,
)

from areal_jax.config import ConfigError
from rollout.config import WorkflowConfig
from rollout.engine import SamplingParams
from rollout.workflows import RolloutTask, load_workflow
from rollout.workflows.base import INSERTED_TOKEN_VERSION
from rollout.workflows.examples import CheckYourAnswerWorkflow
from rollout.workflows.single_turn import SingleTurnWorkflow


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _task(prompt="12+7=", group_size=4, answer="19", **sampling) -> RolloutTask:
    sampling = {"max_new_tokens": 8, **sampling}
    return RolloutTask(
        request_id="q1",
        prompt_ids=tuple(encode(prompt)),
        sampling=SamplingParams(**sampling),
        group_size=group_size,
        reward_name="exact",
        metadata={"answer": answer},
    )


def test_single_turn_group_scores_each_decoded_answer(tokenizer):
    engine, scorer = ArithmeticEngine(), ExactAnswerScorer()
    task = _task(seed=10, temperature=1.0)
    group = asyncio.run(SingleTurnWorkflow(tokenizer).run(task, engine, scorer))

    assert group.group_id == "q1"
    # seeds 10, 11, 12, 13: even seeds answer 19 (right), odd ones 20 (wrong)
    assert [t.reward for t in group.trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert sorted(c[1] for c in scorer.calls) == ["19", "19", "20", "20"]
    assert all(c[0] == "exact" and c[2] == {"answer": "19"} for c in scorer.calls)
    first = group.trajectories[0]
    np.testing.assert_array_equal(first.prompt_ids, encode("12+7="))
    np.testing.assert_array_equal(first.output_ids, encode("19") + [EOS_ID])
    np.testing.assert_allclose(first.behav_logprobs, [-1.0, -1.01, -1.02])
    np.testing.assert_array_equal(first.versions, [0, 0, 0])
    assert first.finish_reason == "stop"
    # every sample went to the engine with its own id and seed
    sent = sorted((rid, p.seed) for rid, _, p in engine.requests)
    assert sent == [("q1/0", 10), ("q1/1", 11), ("q1/2", 12), ("q1/3", 13)]


def test_single_turn_truncated_answer_is_scored_as_is(tokenizer):
    engine, scorer = ArithmeticEngine(), ExactAnswerScorer()
    task = _task(group_size=1, temperature=0.0, max_new_tokens=1)
    group = asyncio.run(SingleTurnWorkflow(tokenizer).run(task, engine, scorer))
    (traj,) = group.trajectories
    assert traj.finish_reason == "length"
    np.testing.assert_array_equal(traj.output_ids, encode("1"))
    assert scorer.calls == [("exact", "1", {"answer": "19"})]
    assert traj.reward == 0.0


def test_single_turn_aborted_answers_are_not_scored(tokenizer):
    engine, scorer = ArithmeticEngine(step_s=0.01), ExactAnswerScorer()
    task = _task(prompt="no sum here", group_size=2, max_new_tokens=40)

    async def scenario():
        run = asyncio.create_task(SingleTurnWorkflow(tokenizer).run(task, engine, scorer))
        await until(lambda: engine.tokens >= 4)
        await engine.shutdown()
        return await run

    group = asyncio.run(scenario())
    assert [t.finish_reason for t in group.trajectories] == ["abort", "abort"]
    assert all(0 < len(t.output_ids) < 40 for t in group.trajectories)
    assert [t.reward for t in group.trajectories] == [0.0, 0.0]
    assert scorer.calls == []


def test_sample_params_offset_the_seed_per_sample():
    task = _task(seed=5)
    assert [task.sample_params(i).seed for i in range(3)] == [5, 6, 7]
    assert task.sample_id(2) == "q1/2"
    assert _task().sample_params(3).seed is None


def test_check_your_answer_masks_the_inserted_turn(tokenizer):
    engine, scorer = ArithmeticEngine(), ExactAnswerScorer()
    workflow = CheckYourAnswerWorkflow(tokenizer, check_text=" ok?")
    task = _task(group_size=1, temperature=0.0, max_new_tokens=12)
    group = asyncio.run(workflow.run(task, engine, scorer))

    (traj,) = group.trajectories
    answer = encode("19") + [EOS_ID]
    check = encode(" ok?")
    np.testing.assert_array_equal(traj.output_ids, answer + check + answer)
    np.testing.assert_array_equal(traj.output_mask, [1] * 3 + [0] * 4 + [1] * 3)
    np.testing.assert_array_equal(traj.versions, [0] * 3 + [INSERTED_TOKEN_VERSION] * 4 + [0] * 3)
    np.testing.assert_allclose(traj.behav_logprobs[3:7], 0.0)
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    # the second turn saw prompt + first answer + check turn, with the budget that was left
    (_, first_prompt, _), (second_id, second_prompt, second_params) = engine.requests
    assert second_id == "q1/0/check"
    assert second_prompt == first_prompt + answer + check
    assert second_params.max_new_tokens == 12 - 3 - 4


def test_check_your_answer_stops_after_one_turn_without_budget(tokenizer):
    engine, scorer = ArithmeticEngine(), ExactAnswerScorer()
    workflow = CheckYourAnswerWorkflow(tokenizer, check_text=" ok?")
    task = _task(group_size=2, temperature=0.0, max_new_tokens=7)
    group = asyncio.run(workflow.run(task, engine, scorer))
    assert len(engine.requests) == 2
    for traj in group.trajectories:
        np.testing.assert_array_equal(traj.output_ids, encode("19") + [EOS_ID])
        assert traj.reward == 1.0


def test_load_workflow_builds_the_named_class_with_its_options(tokenizer):
    path = "rollout.workflows.examples.CheckYourAnswerWorkflow"
    workflow = load_workflow(WorkflowConfig(path=path, options={"check_text": "?"}), tokenizer)
    assert isinstance(workflow, CheckYourAnswerWorkflow)
    assert workflow.check_ids == encode("?")
    assert isinstance(load_workflow(WorkflowConfig(), tokenizer), SingleTurnWorkflow)
    colon_path = "rollout.workflows.single_turn:SingleTurnWorkflow"
    colon = load_workflow(WorkflowConfig(path=colon_path), tokenizer)
    assert isinstance(colon, SingleTurnWorkflow)


@pytest.mark.parametrize(
    "path, options, message",
    [
        ("nowhere.Workflow", {}, r"workflow\.path: cannot import nowhere"),
        ("SingleTurnWorkflow", {}, r"workflow\.path: .* not a dotted path"),
        ("rollout.engine.SamplingParams", {}, r"workflow\.path: .* not a subclass"),
        ("rollout.workflows.single_turn.SingleTurnWorkflow", {"turns": 2}, r"workflow\.options"),
        ("rollout.workflows.examples.CheckYourAnswerWorkflow", {"check_text": ""}, r"no tokens"),
    ],
)
def test_load_workflow_errors_name_the_config_key(tokenizer, path, options, message):
    with pytest.raises(ConfigError, match=message):
        load_workflow(WorkflowConfig(path=path, options=options), tokenizer)
