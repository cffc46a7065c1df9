"""Typed configuration of a prompt dataset."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from areal_jax.config import ConfigError


@dataclasses.dataclass
class DatasetConfig:
    """A local JSONL or Parquet prompt dataset and how to turn its rows into prompts.

    ``metadata_fields`` maps the metadata key the reward reads (``answer``, ``tests``) to the
    column holding it. ``id_field`` names a column with stable ids (else the row number is used).
    The prompt is ``prompt_field``'s text followed by ``instruction_suffix``; with
    ``use_chat_template`` it is wrapped as one user turn (after an optional system turn) by the
    tokenizer's chat template, otherwise ``system_prompt`` (when set) and the text are joined by a
    newline and tokenized as is.
    """

    path: str
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    prompt_field: str = "question"
    metadata_fields: dict[str, str] = dataclasses.field(
        default_factory=lambda: {"answer": "answer"}
    )
    id_field: str | None = None
    reward: str = "math"
    system_prompt: str | None = None
    instruction_suffix: str = ""
    use_chat_template: bool = True
    max_prompt_tokens: int = 1024
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        if not self.path:
            raise ValueError("dataset.path is empty")
        if not self.prompt_field:
            raise ValueError("dataset.prompt_field is empty")
        if self.max_prompt_tokens < 1:
            raise ValueError(
                f"dataset.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"
            )
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"dataset.seed must be in [0, 2**32), got {self.seed}")
        for key, column in self.metadata_fields.items():
            if not key or not isinstance(column, str) or not column:
                hint = (" (YAML reads {a:b} as one key 'a:b': write {a: b}, a space after the "
                        "colon)" if column is None and isinstance(key, str) and ":" in key
                        else "")
                raise ValueError(f"dataset.metadata_fields: {key!r} must map to a column "
                                 f"name{hint}")

    def resolved_format(self, section: str = "dataset") -> str:
        """``format``, or the one the file suffix implies when ``auto`` (an error names
        ``section``'s ``format``)."""
        if self.format != "auto":
            return self.format
        suffix = Path(self.path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            return "jsonl"
        if suffix in (".parquet", ".pq"):
            return "parquet"
        raise ConfigError(
            f"{section}.format: cannot infer the format of {self.path!r} from its suffix "
            f"(.jsonl or .parquet); set {section}.format"
        )
