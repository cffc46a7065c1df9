"""``areal-jax`` command line: one subcommand per module in ``areal_jax.commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import pkgutil
import sys

from areal_jax import __version__, commands


def _command_modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{commands.__name__}.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal-jax", description="Fully asynchronous RL for language reasoning models, in JAX."
    )
    parser.add_argument("--version", action="version", version=f"areal-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that report bad input (config, model, checkpoint, data) or a run stopped for a
    stated reason (servers failing, requests rejected): shown without traceback."""
    from areal_jax.config import ConfigError
    from areal_jax.controller.evaluation import EvaluationFailedError
    from areal_jax.controller.local_servers import ServerExitedError
    from areal_jax.controller.loop import RolloutRejectedError
    from areal_jax.controller.reward_watch import RewardFailingError
    from areal_jax.controller.rollout_pool import NoLiveServerError, RequestFailedError
    from areal_jax.controller.rollout_pool import ServerRefusedError, WeightsRejectedError
    from areal_jax.data.loading import DatasetError
    from areal_jax.models.config import ModelConfigError
    from areal_jax.models.hf_export import ExportTargetError
    from areal_jax.models.hf_io import CheckpointError
    from areal_jax.models.safetensors_io import SafetensorsError
    from areal_jax.parallel.trainer_group import TrainerGroupBrokenError
    from areal_jax.rewards.registry import RewardNotFoundError
    from areal_jax.trainer.checkpoint import CheckpointCorruptError, CheckpointMismatchError
    from areal_jax.trainer.trainer import TrainingDivergedError

    return (ConfigError, DatasetError, ModelConfigError, CheckpointError, SafetensorsError,
            RewardNotFoundError, CheckpointMismatchError, CheckpointCorruptError,
            ServerExitedError, ExportTargetError,
            RolloutRejectedError, RewardFailingError, NoLiveServerError, RequestFailedError,
            ServerRefusedError, WeightsRejectedError, EvaluationFailedError,
            TrainingDivergedError, TrainerGroupBrokenError)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = [a for a in argv if a == "--config" or a.startswith("--config=")]
    bare = [a for a in argv[1:] if a.endswith((".yaml", ".yml")) and "=" not in a]
    if bare and not named:  # `areal-jax train my.yaml`: argparse would say --config is missing
        print(f"areal-jax: error: the config is named with --config: areal-jax {argv[0]} "
              f"--config {bare[0]}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from areal_jax.processes import rollout_shadowed_by

    hidden = rollout_shadowed_by()
    if hidden:
        print(f"areal-jax {args.command}: error: a module of yours hides areal-jax's package "
              f"of the same name (rollout: {hidden}), through PYTHONPATH or the current "
              "directory: rename it", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except Exception as e:
        storage = _storage_error(e)
        # a user error that names its setting (a model it cannot read) keeps its own message
        if storage is not None and (storage.errno in _OUT_OF_SPACE
                                    or not isinstance(e, _user_errors())):
            again = ("run the same command again: it resumes from the last checkpoint"
                     if args.command == "train" else "run the command again")
            fix = ("free space" if storage.errno in _OUT_OF_SPACE else "make it writable"
                   if storage.errno == errno.EROFS else "check its permissions")
            print(f"areal-jax {args.command}: error: {storage.strerror}"
                  f"{f': {storage.filename}' if storage.filename else ''} ({fix}, then {again})",
                  file=sys.stderr)
            return 1
        if not isinstance(e, _user_errors()):
            raise
        print(f"areal-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _storage_error(error: BaseException | None) -> OSError | None:
    """The out-of-space or not-writable ``OSError`` behind ``error``, if any, followed through
    its causes (a checkpoint or publishing error wraps it; a file closed after the failure
    raises its own, without the file's name): the first of them that names its file, else the
    first."""
    seen, found = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _OUT_OF_SPACE + _NOT_WRITABLE:
            found.append(error)
        error = error.__cause__ or error.__context__
    return next((e for e in found if e.filename), found[0] if found else None)


if __name__ == "__main__":
    sys.exit(main())
