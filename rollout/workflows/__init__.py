"""Workflows: how one request becomes a trajectory group (see ``base`` for the plug-in contract)."""

from __future__ import annotations

import importlib

from areal_jax.config import ConfigError
from rollout.config import WorkflowConfig
from rollout.workflows.base import RewardScorer, RolloutTask, Tokenizer, Workflow, sample_group

__all__ = [
    "RewardScorer",
    "RolloutTask",
    "Tokenizer",
    "Workflow",
    "load_workflow",
    "sample_group",
]


def load_workflow(config: WorkflowConfig, tokenizer: Tokenizer) -> Workflow:
    """Import the class named by ``config.path`` (``package.module.Class``) and construct it."""
    module_name, _, class_name = config.path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ConfigError(f"workflow.path: {config.path!r} is not a dotted path module.Class")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"workflow.path: cannot import {module_name} ({e})") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ConfigError(
            f"workflow.path: {config.path} is not a subclass of rollout.workflows.Workflow"
        )
    try:
        return cls(tokenizer=tokenizer, **config.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"workflow.options: {cls.__name__} rejected them: {e}") from e
