"""A tokenized prompt dataset: rows of a local file become :class:`PromptItem` s."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from areal_jax.data.config import DatasetConfig
from areal_jax.data.loading import DatasetError, read_rows
from areal_jax.data.prompts import render_prompts
from areal_jax.data.sampler import PromptIterator

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt: a stable id, its text and token ids, and the metadata its reward reads."""

    id: str
    prompt_ids: list[int]
    prompt_text: str
    metadata: dict


class PromptDataset(Sequence[PromptItem]):
    """All rows of ``config.path`` whose prompt fits ``config.max_prompt_tokens``.

    ``num_dropped`` counts the rows left out for being too long. ``section``: the config
    section it comes from (``dataset``, ``eval.dataset``), named in errors.
    """

    def __init__(self, config: DatasetConfig, tokenizer, section: str = "dataset"):
        self.config = config
        path = Path(config.path)
        rows = read_rows(path, config.resolved_format(section), f"{section}.path")
        ids, questions, metadata = [], [], []
        seen: dict[str, str] = {}
        # a prompt of raw text (use_chat_template: false) may carry its own template's tokens
        control = _control_tokens(tokenizer) if config.use_chat_template else None
        for index, (where, row) in enumerate(rows):
            question = _field(row, config.prompt_field, path, where,
                              f"{section}.prompt_field")
            if not isinstance(question, str) or not question.strip():
                raise DatasetError(
                    f"{path} {where}: field {config.prompt_field!r} must be a non-empty string"
                )
            _check_text(question, f"{path} {where}: field {config.prompt_field!r}")
            _check_no_control_tokens(question, control,
                                     f"{path} {where}: field {config.prompt_field!r}")
            item_id = (
                _item_id(_field(row, config.id_field, path, where, f"{section}.id_field"),
                         f"{path} {where}: field {config.id_field!r}")
                if config.id_field
                else f"{path.stem}-{index}"
            )
            if item_id in seen:
                raise DatasetError(
                    f"{path} {where}: id {item_id!r} already used at {seen[item_id]}"
                )
            seen[item_id] = where
            ids.append(item_id)
            questions.append(question)
            metadata.append(
                {
                    key: _wire_value(_field(row, column, path, where,
                                            f"{section}.metadata_fields.{key}"),
                                     f"{path} {where}: field {column!r}")
                    for key, column in config.metadata_fields.items()
                }
            )
        try:
            rendered = render_prompts(questions, tokenizer, config, section)
        except ValueError as e:
            raise DatasetError(str(e)) from e
        self._items = [
            PromptItem(id=i, prompt_ids=tokens, prompt_text=text, metadata=meta)
            for i, (text, tokens), meta in zip(ids, rendered, metadata, strict=True)
            if len(tokens) <= config.max_prompt_tokens
        ]
        self.num_dropped = len(rows) - len(self._items)
        if self.num_dropped:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_tokens=%d",
                path,
                self.num_dropped,
                len(rows),
                config.max_prompt_tokens,
            )
        if not self._items:
            raise DatasetError(
                f"{path}: every prompt is longer than "
                f"{section}.max_prompt_tokens={config.max_prompt_tokens}"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        return self._items[index]

    def iterator(self) -> PromptIterator:
        """An endless, resumable iterator with this dataset's shuffle setting and seed."""
        return PromptIterator(self, seed=self.config.seed, shuffle=self.config.shuffle)


def _field(row: dict, name: str, path: Path, where: str, setting: str):
    """``row[name]``; a row without it is an error naming the ``setting`` that asked for it and
    the fields the row has."""
    if name not in row:
        fields = ", ".join(map(repr, list(row)[:20])) + (", ..." if len(row) > 20 else "")
        raise DatasetError(f"{path} {where}: missing field {name!r} ({setting}); the row has "
                           f"{fields or 'no fields'}")
    return row[name]


MAX_ID_CHARS = 200  # a request id is "<index>:<id>", and servers take ids up to 256 characters


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DatasetError(f"{where}: not valid Unicode text ({e.reason} at character "
                           f"{e.start})") from None


def _control_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of any special token of ``tokenizer`` (``<|im_end|>``,
    ...), or None when it has none."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    tokens = {*getattr(tokenizer, "all_special_tokens", ()),
              *(t.content for t in added if t.special)} - {""}
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _check_no_control_tokens(question: str, control: re.Pattern | None, where: str) -> None:
    """A question holding the text of a special token (``<|im_end|>``) would be tokenized as
    that control token inside the chat template: a turn closed, another opened by the data."""
    found = control.search(question) if control is not None else None
    if found:
        raise DatasetError(f"{where}: contains the tokenizer's special token "
                           f"{found.group()!r}, which would act as a control token in the "
                           "prompt")


def _item_id(value, where: str) -> str:
    """A row's id as the string requests carry: a string or an integer, at most
    ``MAX_ID_CHARS`` characters."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DatasetError(f"{where}: an id must be a string or an integer, got "
                           f"{type(value).__name__}")
    item_id = str(value)
    _check_text(item_id, where)
    if not item_id or len(item_id) > MAX_ID_CHARS:
        raise DatasetError(f"{where}: an id must have 1 to {MAX_ID_CHARS} characters, got "
                           f"{len(item_id)}")
    return item_id


def metadata_text(value) -> str:
    """A metadata value as it travels with a request, and as the reward (and SFT's target)
    reads it: a string as it is, anything else as its JSON text."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _wire_value(value, where: str):
    """``value`` if it can travel with a request (a string as it is, anything else as JSON);
    never null: the reward would read the text ``"null"`` as the row's value."""
    if value is None:
        raise DatasetError(f"{where}: is null; the reward reads every metadata value of every "
                           "row (fill it in or drop the row)")
    if isinstance(value, str):
        _check_text(value, where)
        return value
    try:
        json.dumps(value, allow_nan=False)  # NaN would reach the reward as the text "NaN"
    except (TypeError, ValueError, RecursionError) as e:
        raise DatasetError(f"{where}: a metadata value must be text or JSON data, with finite "
                           f"numbers ({type(value).__name__}: {e})") from None
    _check_text(metadata_text(value), where)  # a string inside it too
    return value
