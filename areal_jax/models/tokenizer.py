"""Loading a model directory's tokenizer, checked against the model it serves.

transformers builds a tokenizer from ``tokenizer_config.json`` alone, without its vocabulary: a
model directory missing (or with an unreadable) ``tokenizer.json`` gets a tokenizer of a few
special tokens that encodes every text to nothing, and a run trains to its end on empty
prompts. A tokenizer of a larger model gives ids past the embedding, which the model's lookup
clamps and the log-probs turn into NaN. Both are refused here.
"""

from __future__ import annotations

from pathlib import Path

from areal_jax.models.config import ModelConfigError

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # vocab.json: + merges.txt
PROBE_TEXT = "Compute 12 + 7, then answer."


def check_vocabulary(path: str | Path, where: str) -> None:
    """Raise ``ModelConfigError`` (naming ``where``) unless ``path`` holds a tokenizer
    vocabulary file (see ``VOCABULARY_FILES``)."""
    if not any((Path(path) / name).is_file() for name in VOCABULARY_FILES):
        raise ModelConfigError(
            f"{where}: {path} has no tokenizer vocabulary (any of {', '.join(VOCABULARY_FILES)}; "
            "vocab.json with merges.txt): copy the model's tokenizer files in")


def check_tokenizer(tokenizer, vocab_size: int, where: str) -> None:
    """Raise ``ModelConfigError`` (naming ``where``) unless ``tokenizer`` has at most
    ``vocab_size`` tokens and encodes text to tokens."""
    size = len(tokenizer)
    if size > vocab_size:
        raise ModelConfigError(
            f"{where}: the tokenizer has {size} tokens, more than the model's vocab_size "
            f"{vocab_size}: it is another model's tokenizer (ids past the embedding would be "
            "clamped, and their log-probs NaN)")
    if not tokenizer.encode(PROBE_TEXT, add_special_tokens=False):
        raise ModelConfigError(
            f"{where}: the tokenizer encodes text to no tokens: its vocabulary is missing or "
            f"unreadable (any of {', '.join(VOCABULARY_FILES)}, vocab.json with merges.txt)")


def load_tokenizer(path: str | Path, vocab_size: int | None, where: str | None = None):
    """``AutoTokenizer.from_pretrained(path)``, its vocabulary present (``check_vocabulary``)
    and, given ``vocab_size``, checked with ``check_tokenizer`` against a model of that many
    tokens; errors (``ModelConfigError``) name ``where`` (default: the path)."""
    from transformers import AutoTokenizer

    where = where or str(path)
    check_vocabulary(path, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - whatever a malformed file makes the loader raise
        # (a tokenizer.json nested too deep: RecursionError), the run stops naming the setting
        raise ModelConfigError(f"{where}: cannot load a tokenizer from {path}: "
                               f"{type(e).__name__}: {e!s:.300}") from e
    if vocab_size is not None:
        check_tokenizer(tokenizer, vocab_size, where)
    return tokenizer
