"""A tokenized prompt dataset: rows of a local file become :class:`PromptItem` s."""

from __future__ import annotations

import dataclasses
import logging
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

    ``num_dropped`` counts the rows left out for being too long.
    """

    def __init__(self, config: DatasetConfig, tokenizer):
        self.config = config
        path = Path(config.path)
        rows = read_rows(path, config.resolved_format())
        ids, questions, metadata = [], [], []
        seen: dict[str, str] = {}
        for index, (where, row) in enumerate(rows):
            question = _field(row, config.prompt_field, path, where)
            if not isinstance(question, str) or not question.strip():
                raise DatasetError(
                    f"{path} {where}: field {config.prompt_field!r} must be a non-empty string"
                )
            item_id = (
                str(_field(row, config.id_field, path, where))
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
                    key: _field(row, column, path, where)
                    for key, column in config.metadata_fields.items()
                }
            )
        try:
            rendered = render_prompts(questions, tokenizer, config)
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
                f"dataset.max_prompt_tokens={config.max_prompt_tokens}"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        return self._items[index]

    def iterator(self) -> PromptIterator:
        """An endless, resumable iterator with this dataset's shuffle setting and seed."""
        return PromptIterator(self, seed=self.config.seed, shuffle=self.config.shuffle)


def _field(row: dict, name: str, path: Path, where: str):
    if name not in row:
        raise DatasetError(f"{path} {where}: missing field {name!r}")
    return row[name]
