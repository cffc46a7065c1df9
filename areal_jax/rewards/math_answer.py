"""Math answer reward: 1.0 when math-verify finds the completion's answer equal to the gold one.

The model is asked to put its final answer in ``\\boxed{}``. We keep math-verify's default
extraction: every ``\\boxed{}`` of the completion is read, together, as the answer (so hedging
with two boxed values does not match a single gold value); without a box it falls back to an
"answer: X" / "final answer is X" anchor and then to the last number or expression in the text.
math-verify enforces its own time limits with ``signal.alarm``, so call this only from a
process's main thread (``RewardPool`` workers do).
"""

from __future__ import annotations


def _parse_gold(answer: str):
    from math_verify import parse

    text = answer.strip()
    if not text:
        raise ValueError("metadata 'answer' is empty")
    # A bare gold answer such as "\sqrt{2}" has no delimiter math-verify can anchor on.
    gold = parse(text) if "\\boxed" in text else parse(f"\\boxed{{{text}}}")
    if not gold:
        gold = parse(text)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    return gold


def math_reward(completion: str, metadata: dict) -> float:
    """1.0 if the completion's final answer equals ``metadata["answer"]``, else 0.0."""
    from math_verify import parse, verify

    if "answer" not in metadata:
        raise KeyError("math reward needs metadata 'answer'")
    gold = _parse_gold(str(metadata["answer"]))
    pred = parse(completion)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0
