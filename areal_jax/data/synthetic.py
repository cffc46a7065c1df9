"""Synthetic multi-step arithmetic: a verifiable task a ~1-3M parameter model can learn on CPU.

A problem is a chain of single-digit additions and subtractions, e.g. question
``"Compute 7+5-3+8."`` with the reference chain of thought
``"7+5=12. 12-3=9. 9+8=17. Answer: 17"``. The number of steps k follows a truncated power law,
``P(k) ∝ k^-step_alpha`` for ``min_steps <= k <= max_steps`` (by default 1 to 12: about half
the problems have one step, a few percent ten or more), so response lengths vary widely. A step
is about 6-7 tokens of solution (2 of question) with the tiny kit's tokenizer, so ``min_steps:
2, max_steps: 64, step_alpha: 1.5`` gives the long tail of reasoning: median 5 steps, 1% over
58, up to about 420 solution tokens. Every intermediate result stays within ``[0, max_value]``.

The train/test split partitions the space of questions by a hash of the question text, so no
question can appear in both splits, whatever the seed; within a split problems are drawn i.i.d.
(repeats are possible). Generation is deterministic given the config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Literal

from areal_jax.files import write_atomic

Split = Literal["train", "test"]
_ANSWER = re.compile(r"Answer:\s*(-?\d+)(?!\d|\.\d)")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """How many problems of which shape; ``test_fraction`` is the test share of question space."""

    num_train: int = 20000
    num_test: int = 500
    min_steps: int = 1
    max_steps: int = 12
    step_alpha: float = 1.6
    max_value: int = 40
    test_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self):
        for name in ("num_train", "num_test"):
            if getattr(self, name) < 0:
                raise ValueError(f"synthetic.{name} must be >= 0, got {getattr(self, name)}")
        if self.min_steps < 1:
            raise ValueError(f"synthetic.min_steps must be >= 1, got {self.min_steps}")
        if self.max_steps < self.min_steps:
            raise ValueError(
                f"synthetic.max_steps must be >= min_steps ({self.min_steps}), got {self.max_steps}"
            )
        if self.step_alpha < 0:
            raise ValueError(f"synthetic.step_alpha must be >= 0, got {self.step_alpha}")
        if self.max_value < 10:
            raise ValueError(f"synthetic.max_value must be >= 10, got {self.max_value}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"synthetic.test_fraction must be in (0, 1), got {self.test_fraction}")


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    question: str
    solution: str
    answer: int
    steps: int


def step_probabilities(max_steps: int, alpha: float, min_steps: int = 1) -> list[float]:
    """P(k) for k = min_steps..max_steps, proportional to k^-alpha."""
    weights = [k**-alpha for k in range(min_steps, max_steps + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def sample_problem(rng: random.Random, cfg: SyntheticConfig) -> ArithProblem:
    """One problem drawn from ``rng``."""
    steps = rng.choices(
        range(cfg.min_steps, cfg.max_steps + 1),
        step_probabilities(cfg.max_steps, cfg.step_alpha, cfg.min_steps),
    )[0]
    value = rng.randint(1, 9)
    expression, lines = str(value), []
    for _ in range(steps):
        ops = []
        if value + 1 <= cfg.max_value:
            ops.append("+")
        if value >= 1:
            ops.append("-")
        op = rng.choice(ops)
        if op == "+":
            operand = rng.randint(1, min(9, cfg.max_value - value))
            new = value + operand
        else:
            operand = rng.randint(1, min(9, value))
            new = value - operand
        expression += f"{op}{operand}"
        lines.append(f"{value}{op}{operand}={new}.")
        value = new
    return ArithProblem(
        question=f"Compute {expression}.",
        solution=" ".join(lines) + f" Answer: {value}",
        answer=value,
        steps=steps,
    )


def split_of(question: str, test_fraction: float) -> Split:
    """Which split a question belongs to: a fixed hash partition of question space."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


def generate_split(cfg: SyntheticConfig, split: Split) -> list[ArithProblem]:
    """``cfg.num_train`` or ``cfg.num_test`` problems of ``split``, deterministic in ``cfg``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    count = cfg.num_train if split == "train" else cfg.num_test
    rng = random.Random(f"areal-jax-synthetic-{cfg.seed}-{split}")
    problems: list[ArithProblem] = []
    while len(problems) < count:
        problem = sample_problem(rng, cfg)
        if split_of(problem.question, cfg.test_fraction) == split:
            problems.append(problem)
    return problems


def sft_pairs(problems: list[ArithProblem]) -> list[tuple[str, str]]:
    """(prompt text, reference response) pairs for a supervised warm start."""
    return [(p.question, p.solution) for p in problems]


def write_jsonl(problems: list[ArithProblem], path: str | Path, split: Split) -> Path:
    """Write rows with fields id, question, answer, solution, steps (whole or not at all)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps({"id": f"{split}-{i:06d}", **dataclasses.asdict(p)})
                               + "\n" for i, p in enumerate(problems)))
    return path


def write_synthetic_splits(out_dir: str | Path, cfg: SyntheticConfig) -> dict[str, Path]:
    """Write ``test.jsonl`` and then ``train.jsonl`` under ``out_dir`` (a run takes the files as
    written once train.jsonl exists); returns their paths."""
    out_dir = Path(out_dir)
    return {
        split: write_jsonl(generate_split(cfg, split), out_dir / f"{split}.jsonl", split)
        for split in ("test", "train")
    }


def parse_final_answer(text: str) -> int | None:
    """The integer of the last "Answer: N" in ``text``, or None."""
    matches = _ANSWER.findall(text)
    return int(matches[-1]) if matches else None


def synthetic_arith_reward(completion: str, metadata: dict) -> float:
    """1.0 iff the completion's final "Answer: N" equals ``metadata["answer"]``."""
    if "answer" not in metadata:
        raise KeyError("synthetic_arith reward needs metadata 'answer'")
    predicted = parse_final_answer(completion)
    return 1.0 if predicted is not None and predicted == int(metadata["answer"]) else 0.0
