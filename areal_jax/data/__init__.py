"""Prompt datasets (local JSONL/Parquet), resumable iteration and the synthetic arithmetic task."""

from areal_jax.data.config import DatasetConfig
from areal_jax.data.dataset import PromptDataset, PromptItem
from areal_jax.data.loading import DatasetError
from areal_jax.data.prompts import render_prompts
from areal_jax.data.sampler import PromptIterator

__all__ = [
    "DatasetConfig",
    "DatasetError",
    "PromptDataset",
    "PromptItem",
    "PromptIterator",
    "render_prompts",
]
