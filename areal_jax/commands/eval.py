"""``areal-jax eval --config CONFIG (--model DIR | --curve RUN_DIR)``: held-out accuracy of an
HF checkpoint, or of every version a finished run kept (its accuracy curve)."""

from __future__ import annotations

import argparse

NAME = "eval"
HELP = "Accuracy of a Hugging Face checkpoint on the config's eval dataset, through rollout servers."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment YAML (its eval and rollout sections)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="Hugging Face checkpoint directory")
    which.add_argument(
        "--curve", metavar="RUN_DIR",
        help="every export kept under RUN_DIR/exports (see trainer.export_keep_every), oldest "
             "first, through one set of rollout servers; writes RUN_DIR/eval_curve.jsonl",
    )  # fmt: skip
    parser.add_argument(
        "--samples", metavar="FILE",
        help="also write every answer to FILE, one JSON object per line: the prompt, the "
             "completion's text, its reward and finish reason (with the checkpoint or version)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import json
    import sys
    from pathlib import Path

    from areal_jax.commands._preflight import preflight
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.evaluation import evaluate_checkpoints
    from areal_jax.controller.prepare import check_model_dir
    from areal_jax.experiment import ExperimentConfig
    from areal_jax.files import write_jsonl
    from areal_jax.metrics import EVAL_CURVE_FILE
    from areal_jax.trainer import list_exports

    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    if cfg.eval.dataset is not None:  # the training reward plays no part: neither checked
        # nor imported by the servers (it may live in a package this machine lacks)
        cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(
            cfg.dataset, reward=cfg.eval.dataset.reward))
    preflight(cfg, evaluation_only=cfg.eval.dataset is not None)
    if args.samples:  # checked before any server starts: the answers are written at the end
        _check_output_file(Path(args.samples), "--samples")
    samples: list[list[dict]] | None = [] if args.samples else None

    def write_samples(keys: list[dict]) -> None:
        if samples is not None:
            write_jsonl(args.samples, ({**key, **record} for key, answers in zip(keys, samples)
                                       for record in answers))
            print(f"wrote {sum(map(len, samples))} answers to {args.samples}", file=sys.stderr)

    if args.model is not None:
        model = check_model_dir(Path(args.model), "--model")
        result = asyncio.run(evaluate_checkpoints(cfg, [model], samples))[0]
        print(f"{model} on {cfg.eval.dataset.path} (reward {cfg.eval.dataset.reward}):",
              file=sys.stderr)
        print(json.dumps(result, indent=2))
        write_samples([{"model": str(model)}])
        return 0
    exports_dir = Path(args.curve) / "exports"
    exports = list_exports(exports_dir) if exports_dir.is_dir() else []
    if not exports:
        raise ConfigError(f"--curve: no version exports under {exports_dir}")
    if not cfg.trainer.export_keep_every:
        print(f"note: with trainer.export_keep_every unset a run keeps only its newest "
              f"{cfg.trainer.export_keep} exports ({len(exports)} under {exports_dir}); a run "
              "keeps more for its curve with trainer.export_keep_every=K", file=sys.stderr)
    results = asyncio.run(evaluate_checkpoints(cfg, [path for _, path in exports], samples))
    out = Path(args.curve) / EVAL_CURVE_FILE
    write_jsonl(out, ({"step": version, **result} for (version, _), result in zip(exports, results)))
    print("| version | accuracy | mean response tokens |\n|---:|---:|---:|")
    for (version, _), result in zip(exports, results):
        print(f"| {version} | {result['eval/accuracy']:.3f} | "
              f"{result['eval/response_length']:.1f} |")
    print(f"wrote {out}")
    write_samples([{"version": version} for version, _ in exports])
    return 0


def _check_output_file(path, flag: str) -> None:
    """``path`` can be written as a file (its directory made if missing) outside any run
    directory (it would overwrite the run's own files), else a ``ConfigError`` naming
    ``flag``."""
    import os

    from areal_jax.config import ConfigError
    from areal_jax.controller.prepare import FINGERPRINT_FILE

    if path.is_dir():
        raise ConfigError(f"{flag}: {path} is a directory; name the file to write")
    where = path.parent.resolve()
    run_dir = next((d for d in (where, *where.parents) if (d / FINGERPRINT_FILE).is_file()), None)
    if run_dir is not None:
        raise ConfigError(f"{flag}: {path} is inside the run directory {run_dir}, whose files "
                          "it could overwrite (its evaluations keep their answers in "
                          "eval_samples/); write it elsewhere")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot make the directory {path.parent}: {e.strerror}"
                          ) from None
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"{flag}: the directory {path.parent} is not writable")
