"""The synthetic arithmetic task: generation, split, step distribution and its reward."""

import dataclasses
import json
import re

import numpy as np
import pytest

from areal_jax.data.synthetic import (
    SyntheticConfig,
    generate_split,
    parse_final_answer,
    sft_pairs,
    step_probabilities,
    synthetic_arith_reward,
    write_synthetic_splits,
)
from areal_jax.rewards import get_reward

CFG = SyntheticConfig(num_train=4000, num_test=400, seed=7)


@pytest.fixture(scope="module")
def train():
    return generate_split(CFG, "train")


@pytest.fixture(scope="module")
def test_split():
    return generate_split(CFG, "test")


def _evaluate(question: str) -> int:
    expression = question.removeprefix("Compute ").removesuffix(".")
    assert re.fullmatch(r"\d([+-]\d)+", expression), question
    return eval(expression)  # digits and +/- only, checked above


def test_generation_is_deterministic_by_seed(train):
    assert generate_split(CFG, "train") == train
    other = generate_split(SyntheticConfig(num_train=4000, num_test=400, seed=8), "train")
    assert [p.question for p in other] != [p.question for p in train]


def test_split_sizes_and_no_question_in_both_splits(train, test_split):
    assert len(train) == 4000 and len(test_split) == 400
    assert not {p.question for p in train} & {p.question for p in test_split}
    other_seed_test = generate_split(SyntheticConfig(num_train=0, num_test=400, seed=99), "test")
    assert not {p.question for p in train} & {p.question for p in other_seed_test}


def test_problems_are_correct_and_stay_small(train):
    for p in train:
        assert _evaluate(p.question) == p.answer
        operands = re.findall(r"\d+", p.question.removeprefix("Compute "))
        assert all(len(o) == 1 for o in operands)
        assert len(operands) == p.steps + 1
        values = [int(v) for v in re.findall(r"=(\d+)\.", p.solution)]
        assert len(values) == p.steps and values[-1] == p.answer
        assert all(0 <= v <= CFG.max_value for v in values)
    assert max(len(p.question) for p in train) < 40


def test_step_counts_are_long_tailed(train):
    steps = np.array([p.steps for p in train])
    assert np.quantile(steps, 0.5) == 1
    assert np.quantile(steps, 0.75) <= 3
    assert np.quantile(steps, 0.95) >= 7
    assert steps.max() == CFG.max_steps
    assert 0.45 < np.mean(steps == 1) < 0.6
    assert 0.04 < np.mean(steps >= 8) < 0.15
    probs = step_probabilities(12, 1.6)
    assert sum(probs) == pytest.approx(1.0) and probs == sorted(probs, reverse=True)
    lengths = [len(p.solution) for p in train]
    assert max(lengths) > 5 * min(lengths)


LONG = SyntheticConfig(num_train=3000, num_test=50, min_steps=2, max_steps=64, step_alpha=1.5,
                       seed=3)


def test_long_tailed_option_bounds_tail_and_determinism():
    problems = generate_split(LONG, "train")
    steps = np.array([p.steps for p in problems])
    assert steps.min() == 2 and steps.max() <= 64
    assert np.quantile(steps, 0.5) <= 6  # most answers stay short...
    assert np.quantile(steps, 0.99) >= 40 and steps.max() >= 56  # ...a few are very long
    assert 0.05 < np.mean(steps >= 32) < 0.12
    probs = step_probabilities(64, 1.5, min_steps=2)
    assert len(probs) == 63 and sum(probs) == pytest.approx(1.0)
    assert np.mean(steps == 2) == pytest.approx(probs[0], abs=0.03)
    solutions = [len(p.solution) for p in problems]
    assert max(solutions) > 400 and max(solutions) > 8 * np.median(solutions)
    for p in problems[:300]:
        assert _evaluate(p.question) == p.answer and p.solution.endswith(f"Answer: {p.answer}")
    assert generate_split(LONG, "train") == problems
    reseeded = generate_split(dataclasses.replace(LONG, seed=4), "train")
    assert [p.question for p in reseeded] != [p.question for p in problems]


def test_reference_solutions_score_one(train, test_split):
    reward = get_reward("synthetic_arith")
    for prompt, response in sft_pairs(train[:500] + test_split):
        answer = _evaluate(prompt)
        assert reward(response, {"answer": answer}) == 1.0
    first = train[0]
    assert first.solution.endswith(f"Answer: {first.answer}")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("7+5=12. 12-3=9. 9+8=17. Answer: 17", 17, 1.0),
        ("7+5=12. Answer: 12", "12", 1.0),
        ("Answer: 17", 17, 1.0),
        ("7+5=12. 12-3=9. 9+8=17. Answer: 16", 17, 0.0),
        ("Answer: 3. Wait. Answer: 17", 17, 1.0),
        ("Answer: 17. Wait. Answer: 3", 17, 0.0),
        ("Answer: 170", 17, 0.0),
        ("Answer: 17.5", 17, 0.0),
        ("Answer: 17.", 17, 1.0),
        ("9+8=17.", 17, 0.0),
        ("answer: 17", 17, 0.0),
        ("", 0, 0.0),
        ("Answer: -2", -2, 1.0),
    ],
)
def test_reward_hand_examples(completion, answer, expected):
    assert synthetic_arith_reward(completion, {"answer": answer}) == expected


def test_parse_final_answer_and_missing_metadata():
    assert parse_final_answer("x Answer:  42 y") == 42
    assert parse_final_answer("no answer") is None
    with pytest.raises(KeyError, match="answer"):
        synthetic_arith_reward("Answer: 1", {})


def test_writers_produce_jsonl_with_ids(tmp_path):
    cfg = SyntheticConfig(num_train=50, num_test=10, seed=1)
    paths = write_synthetic_splits(tmp_path / "synth", cfg)
    rows = {s: [json.loads(line) for line in p.read_text().splitlines()] for s, p in paths.items()}
    assert len(rows["train"]) == 50 and len(rows["test"]) == 10
    assert rows["test"][3]["id"] == "test-000003"
    assert set(rows["train"][0]) == {"id", "question", "answer", "solution", "steps"}
    assert [r["question"] for r in rows["train"]] == [
        p.question for p in generate_split(cfg, "train")
    ]


def test_config_is_validated():
    with pytest.raises(ValueError, match="synthetic.max_value"):
        SyntheticConfig(max_value=5)
    with pytest.raises(ValueError, match="synthetic.test_fraction"):
        SyntheticConfig(test_fraction=1.0)
    with pytest.raises(ValueError, match="synthetic.min_steps must be >= 1"):
        SyntheticConfig(min_steps=0)
    with pytest.raises(ValueError, match=r"synthetic.max_steps must be >= min_steps \(8\)"):
        SyntheticConfig(min_steps=8, max_steps=4)
    with pytest.raises(ValueError, match="split must be"):
        generate_split(CFG, "val")


class _CharTokenizer:
    """One id per character; enough to load the synthetic files as a prompt dataset."""

    chat_template = None

    def __call__(self, texts):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_synthetic_files_load_as_a_prompt_dataset(tmp_path):
    from areal_jax.data import DatasetConfig, PromptDataset

    paths = write_synthetic_splits(tmp_path, SyntheticConfig(num_train=20, num_test=5, seed=2))
    cfg = DatasetConfig(
        path=str(paths["train"]), id_field="id", reward="synthetic_arith", use_chat_template=False
    )
    ds = PromptDataset(cfg, _CharTokenizer())
    problems = generate_split(SyntheticConfig(num_train=20, num_test=5, seed=2), "train")
    assert [x.prompt_text for x in ds] == [p.question for p in problems]
    assert ds[4].id == "train-000004"
    assert ds[4].metadata == {"answer": problems[4].answer}
    assert ds[4].prompt_ids == [ord(c) for c in problems[4].question]
