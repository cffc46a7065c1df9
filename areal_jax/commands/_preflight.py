"""Checks run before a long command starts, so bad input fails in seconds with a clear error
instead of deep inside a rollout server's log."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from areal_jax.config import ConfigError, from_dict
from areal_jax.experiment import ExperimentConfig

log = logging.getLogger(__name__)


def check_rollout_server(cfg: ExperimentConfig) -> None:
    """``rollout.server`` is free-form YAML handed to the servers: validate it as their config."""
    from areal_jax.controller.servers import server_config
    from rollout.config import ServerConfig
    from rollout.engines import check_engine_options

    data = server_config(cfg, Path(cfg.run_dir) / "model", 0)
    try:
        check_engine_options(from_dict(ServerConfig, data).engine)
    except ConfigError as e:
        raise ConfigError(f"rollout.server: {e}") from e


def check_token(cfg: ExperimentConfig) -> None:
    """The variable ``rollout.auth_token_env`` names must hold the token here: unset, the
    trainer would connect without one and the servers' refusal would read as a wrong token."""
    name = cfg.rollout.auth_token_env
    if name and not os.environ.get(name):
        raise ConfigError(f"rollout.auth_token_env: {name} is unset (or empty) in this "
                          f"process's environment; export the servers' token in it, e.g. "
                          f"export {name}=...")


def check_rewards(cfg: ExperimentConfig, evaluation_only: bool = False) -> None:
    """Every reward the run names can be imported here and called as a reward (with the real
    import error if not), each error under the setting that names the reward
    (``evaluation_only``: the training set's reward plays no part, unchecked)."""
    from areal_jax.controller.servers import listed_rewards, with_dataset_reward
    from areal_jax.rewards import check_reward
    from areal_jax.rewards.registry import check_custom

    listed = listed_rewards(cfg)
    try:
        check_custom(listed)
    except ConfigError as e:
        raise ConfigError(f"rollout.server.rewards.custom: {e}") from e
    paths = {f"rollout.server.rewards.custom.{name}": path for name, path in listed.items()}
    for key, dataset in (("dataset", cfg.dataset), ("eval.dataset", cfg.eval.dataset)):
        if dataset is not None and not (evaluation_only and key == "dataset"):
            try:
                check_reward(dataset.reward, with_dataset_reward(listed, dataset.reward))
            except ConfigError as e:
                remote = (" (with remote servers, list a short name in this config's "
                          "rollout.server.rewards.custom too, name: \"pkg.module:function\", as "
                          "in each server's)" if cfg.rollout.remote
                          and not any(c in dataset.reward for c in ".:") else "")
                raise ConfigError(f"{key}.reward: {e}{remote}") from e
            if ":" in dataset.reward:
                paths[f"{key}.reward"] = dataset.reward
    if not cfg.rollout.remote:
        _check_local_servers_import(paths)


def _check_local_servers_import(paths: dict[str, str]) -> None:
    """The local rollout servers can import each reward ``paths`` names (by setting): they
    start without the current directory on their import path."""
    from areal_jax.processes import child_can_import

    importable: dict[str, bool] = {}  # by top-level module: one child asked for each
    for setting, path in paths.items():
        module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        top = module.partition(".")[0]
        if top not in importable:
            importable[top] = child_can_import(top)
        if importable[top]:
            continue
        where = _found_in(top)
        raise ConfigError(
            f"{setting}: the local rollout servers cannot import {top!r} (of {path!r}), which "
            f"this process finds in {where}: they start without the current directory on "
            "their import path (python -m puts it on this process's only); run with "
            f"PYTHONPATH={where}, or install your package")


def _found_in(module: str) -> Path:
    """The directory on this process's import path that holds the top-level ``module``."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec.origin:  # a module's file, or a package's __init__.py
        origin = Path(spec.origin)
        return origin.parent.parent if origin.name == "__init__.py" else origin.parent
    return Path(next(iter(spec.submodule_search_locations))).parent  # a namespace package


def warn_unused_sections(cfg: ExperimentConfig) -> None:
    """Say when the ``synthetic`` section describes a task no dataset reads, or a ``tiny``
    section a model not built: a quickstart config adapted to one's own data or model keeps
    them, and they were ignored without a word."""
    from areal_jax.controller.prepare import synthetic_files_read

    if cfg.tiny is not None and cfg.model_path != "tiny":
        log.warning("tiny: describes the model built for model_path: tiny, but model_path is "
                    "%s: the section is ignored (remove it)", cfg.model_path)
    if cfg.synthetic is not None and not synthetic_files_read(cfg):
        log.warning("synthetic: describes the arithmetic task it would write to %s, but no "
                    "dataset reads it "
                    "(dataset.path: %s): the section is ignored (remove it)",
                    Path(cfg.run_dir) / "data", cfg.dataset.path)


def preflight(cfg: ExperimentConfig, evaluation_only: bool = False) -> None:
    """The checks every command starting rollout servers runs first (``evaluation_only``: the
    servers only evaluate ``eval.dataset``)."""
    check_token(cfg)
    check_rollout_server(cfg)
    check_rewards(cfg, evaluation_only)
    warn_unused_sections(cfg)
