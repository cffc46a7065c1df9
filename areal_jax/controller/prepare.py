"""Preparing a run directory: the base model, the synthetic data, and the run's fingerprint.

Written by the leader process only (a shared filesystem is assumed across trainer processes);
every process then reads the same files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from areal_jax.config import ConfigError, to_dict
from areal_jax.data.config import DatasetConfig
from areal_jax.experiment import ExperimentConfig
from areal_jax.files import read_json, write_atomic
from areal_jax.models.config import ModelConfigError
from areal_jax.models.tiny import TinyModelSpec
from areal_jax.models.tokenizer import check_vocabulary
from areal_jax.protocol.runs import MAX_RUN_ID_CHARS, is_run_id

FINGERPRINT_FILE = "fingerprint.json"
RUN_ID_FILE = "run_id"
# The specs (config sections) the run directory's synthetic data and tiny model were made from.
MADE_FROM_FILE = "made_from.json"
_WEIGHTS_EDGE = 1 << 20  # bytes hashed at each end of a weights file


def fill_run_dir(text: str, run_dir: str) -> str:
    return text.replace("{run_dir}", run_dir)


def dataset_config(cfg: DatasetConfig, run_dir: str) -> DatasetConfig:
    """``cfg`` with ``{run_dir}`` in its path filled in."""
    return dataclasses.replace(cfg, path=fill_run_dir(cfg.path, run_dir))


def base_model_path(cfg: ExperimentConfig) -> Path:
    """The HF directory RL (or SFT) starts from, before any training."""
    if cfg.model_path == "tiny":
        return Path(cfg.run_dir) / "base_model"
    return Path(fill_run_dir(cfg.model_path, cfg.run_dir))


def check_model_dir(path: Path, key: str) -> Path:
    """``path`` if it is a local Hugging Face model directory with its tokenizer's vocabulary
    and the weights its config implies (by their headers), else a ``ConfigError`` naming
    ``key`` (without the vocabulary transformers builds a tokenizer of a few special tokens
    from ``tokenizer_config.json`` alone, and every prompt encodes to nothing; weights that do
    not fit would fail the run only once it started, its run directory taken)."""
    from areal_jax.models.hf_io import CheckpointError, check_hf_weights

    expected = "a local Hugging Face model directory is expected (nothing is downloaded)"
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist; {expected}")
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is a file; {expected}: name the directory holding "
                          "its config.json, weights and tokenizer")
    if (path / FINGERPRINT_FILE).is_file():
        raise ConfigError(
            f"{key}: {path} is a run directory, not a model: name one of its exports "
            f"({path / 'exports'}/v<version>), or write one with `areal-jax export`")
    if path.parent.name == "checkpoints" and (path.parent.parent / FINGERPRINT_FILE).is_file():
        raise ConfigError(
            f"{key}: {path} is a training checkpoint, not a model: `areal-jax export --config "
            f"CONFIG --version {path.name} --out DIR` writes it as one")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} has no config.json; {expected}")
    try:
        check_vocabulary(path, key)
        check_hf_weights(path)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    except CheckpointError as e:
        raise ConfigError(f"{key}: {e}") from None
    return path


def prepare_base_model(cfg: ExperimentConfig) -> Path:
    """The base HF directory; ``tiny`` builds the kit once into the run dir (a kit built from
    another ``tiny`` section by a start refused before it began is refused: ``_check_made``)."""
    path = base_model_path(cfg)
    if cfg.model_path != "tiny":
        return check_model_dir(path, "model_path")
    spec = to_dict(cfg.tiny_model)
    if (path / "config.json").is_file():
        _check_made(cfg, "tiny", spec, path)
    else:
        from areal_jax.models.tiny import build_tiny_model

        _record_made(cfg, "tiny", spec)
        build_tiny_model(path, cfg.tiny_model)  # replaces the directory whole
    return path


def prepare_data(cfg: ExperimentConfig) -> None:
    """Write the synthetic task's files into the run dir when configured and read by a
    dataset, once (files written from another ``synthetic`` section by a start refused before
    it began are refused: ``_check_made``)."""
    if cfg.synthetic is None or not synthetic_files_read(cfg):
        return
    from areal_jax.data.synthetic import write_synthetic_splits

    out = Path(cfg.run_dir) / "data"
    spec = to_dict(cfg.synthetic)
    if (out / "train.jsonl").is_file():  # written last: the files are whole once it is
        _check_made(cfg, "synthetic", spec, out)
        return
    _record_made(cfg, "synthetic", spec)
    write_synthetic_splits(out, cfg.synthetic)


def _check_made(cfg: ExperimentConfig, section: str, spec: dict, made_path: Path) -> None:
    """``ConfigError`` where ``made_path`` was made from another spec of config ``section`` by
    a command that recorded no fingerprint (a start refused by a later check, an evaluation):
    it would be taken as this spec's. Never remade in place: another start may be reading it.
    Once a start has recorded the fingerprint, ``check_fingerprint`` names any change."""
    run_dir = Path(cfg.run_dir)
    record = run_dir / MADE_FROM_FILE
    if (run_dir / FINGERPRINT_FILE).is_file() or not record.is_file():
        return
    made = read_json(record).get(section, spec)
    if made == spec:
        return
    if not isinstance(made, dict):
        raise ConfigError(f"{record} is damaged (its {section} section holds a JSON "
                          f"{type(made).__name__}, not an object): delete {made_path} and "
                          f"{record} to make it again, or use a new run_dir")
    changes = [f"{section}.{k} was {made.get(k)!r}, now {spec.get(k)!r}"
               for k in sorted(set(made) | set(spec)) if made.get(k) != spec.get(k)]
    raise ConfigError(
        f"{made_path} was made from another {section} section ({'; '.join(changes)}) by an "
        "earlier command that trained nothing on it (a start refused before it began, an "
        f"evaluation): delete {made_path} to make it from this one, or use a new run_dir")


def _record_made(cfg: ExperimentConfig, section: str, spec: dict) -> None:
    """Record (before they are made) the spec the files of config ``section`` are made from."""
    path = Path(cfg.run_dir) / MADE_FROM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    made = read_json(path) if path.is_file() else {}
    write_atomic(path, json.dumps({**made, section: spec}, indent=2, sort_keys=True))


def starting_model(cfg: ExperimentConfig) -> Path:
    """The HF directory RL starts from: the SFT warm start when configured, else the base."""
    return Path(cfg.run_dir) / "sft_model" if cfg.sft.steps > 0 else base_model_path(cfg)


def _hash_path(path: Path, digest) -> None:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file():
                digest.update(str(child.relative_to(path)).encode())
                _hash_path(child, digest)
    elif path.is_file():
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)


def _digest(value, data_path: Path | None = None) -> str:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode())
    if data_path is not None:
        _hash_path(data_path, digest)
    return digest.hexdigest()[:16]


def run_fingerprint(cfg: ExperimentConfig) -> dict[str, str]:
    """What the SFT model and the checkpoints of a run depend on, one hash per part: the
    model (its files, or the ``tiny`` spec), the data (config and file contents), the reward
    and the SFT settings. Paths are hashed as written (``{run_dir}`` unfilled), so a run
    directory moved or named by another path is the same run; the model's and the data files'
    contents are hashed wherever they are."""
    return {part: digest(cfg) for part, digest in _FINGERPRINT_PARTS.items()}


def _sft_digest(cfg: ExperimentConfig) -> str:
    return _digest(to_dict(cfg.sft))


def _model_digest(cfg: ExperimentConfig) -> str:
    """The model part: its ``config.json`` and, for each weights file (``*.safetensors`` and
    the index), its name, size and first and last MiB: a model replaced at the same path
    changes these, and hashing whole multi-GB files would take minutes. ``tiny`` is built from
    its spec, which is hashed instead."""
    if cfg.model_path == "tiny":
        return _path_model_digest(cfg)
    path = base_model_path(cfg)
    found = [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]
    # files only: not a FIFO (whose read would hang), a directory or a dangling link
    weights = sorted(f for f in found if f.is_file())
    return _digest({
        "config": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weights": [[f.name, f.stat().st_size, _edges_sha256(f)] for f in weights],
    })


def _edges_sha256(path: Path) -> str:
    """sha256 of a file's first and last MiB (all of a file of up to 2 MiB)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_WEIGHTS_EDGE))
        f.seek(max(path.stat().st_size - _WEIGHTS_EDGE, 0))
        digest.update(f.read(_WEIGHTS_EDGE))
    return digest.hexdigest()


def _path_model_digest(cfg: ExperimentConfig) -> str:
    """The model part as run directories recorded it before the model's files were hashed
    (``tiny`` keeps this form)."""
    return _digest({"model_path": cfg.model_path, "tiny": to_dict(cfg.tiny_model)})


def synthetic_files_read(cfg: ExperimentConfig) -> bool:
    """Whether a dataset (training or held-out) reads the files the ``synthetic`` section
    writes into the run directory."""
    data = Path(cfg.run_dir) / "data"
    written = [(data / f"{split}.jsonl").resolve() for split in ("train", "test")]
    read = [Path(dataset_config(d, cfg.run_dir).path).resolve()
            for d in (cfg.dataset, cfg.eval.dataset) if d is not None]
    return any(path == file or path in file.parents for path in read for file in written)


def _data_digest(cfg: ExperimentConfig, dataset: DatasetConfig,
                 unused_synthetic: bool = False) -> str:
    """The data part: ``dataset`` (the config as hashed), the ``synthetic`` section where a
    dataset reads its files (``unused_synthetic``: also where none does, as recorded before)
    and the data files' contents."""
    synthetic = (to_dict(cfg.synthetic) if cfg.synthetic
                 and (unused_synthetic or synthetic_files_read(cfg)) else None)
    files = Path(dataset_config(cfg.dataset, cfg.run_dir).path)
    return _digest({"dataset": to_dict(dataset), "synthetic": synthetic}, files)


def _filled_path_data_digest(cfg: ExperimentConfig) -> str:
    """The data part as run directories recorded it before paths were hashed as written."""
    return _data_digest(cfg, dataset_config(cfg.dataset, cfg.run_dir), unused_synthetic=True)


def _unused_synthetic_data_digest(cfg: ExperimentConfig) -> str:
    """The data part as run directories recorded it before a ``synthetic`` section no dataset
    reads was left out: with the section configured, or, removed since (as the warning about
    it says), the one the run last started with (its ``config.json``)."""
    recorded = (_recorded_config(cfg) or {}).get("synthetic")
    if cfg.synthetic is None and isinstance(recorded, dict):
        from areal_jax.config import from_dict
        from areal_jax.data.synthetic import SyntheticConfig

        try:
            cfg = dataclasses.replace(cfg, synthetic=from_dict(SyntheticConfig, recorded))
        except (ConfigError, TypeError, ValueError):  # not a section this code reads
            pass
    return _data_digest(cfg, cfg.dataset, unused_synthetic=True)


# Each part of the fingerprint, and the forms older run directories recorded a part in
# (accepted, and recorded anew).
_FINGERPRINT_PARTS = {"model": _model_digest, "data": lambda cfg: _data_digest(cfg, cfg.dataset),
                      "sft": _sft_digest}
_OLDER_FORMS = {"model": (_path_model_digest,),
                "data": (_filled_path_data_digest, _unused_synthetic_data_digest)}


def run_id(cfg: ExperimentConfig) -> str:
    """The run's name in its calls to rollout servers, which refuse weights from any other run
    while this one's trainer is around (``rollout.run_lease``): made on first use, kept in the
    run directory, so a resumed trainer is the same run to them."""
    path = Path(cfg.run_dir) / RUN_ID_FILE
    if not path.is_file():
        write_atomic(path, f"run-{uuid.uuid4().hex}\n")
    ident = path.read_text(errors="replace").strip()
    if not is_run_id(ident):
        raise ConfigError(f"{path}: not a run id (1 to {MAX_RUN_ID_CHARS} printable ASCII "
                          "characters); delete it and a new one is made")
    return ident


def check_fingerprint(cfg: ExperimentConfig) -> None:
    """Record the run's fingerprint on first use of its directory; refuse to go on in a run
    directory whose model, data, reward or SFT settings were since changed (the SFT model and
    checkpoints there would silently be reused)."""
    path = Path(cfg.run_dir) / FINGERPRINT_FILE
    current = run_fingerprint(cfg)
    if not path.is_file():
        write_atomic(path, json.dumps(current, indent=2))
        return
    recorded = read_json(path)
    changed = [k for k in current if recorded.get(k) != current[k]]
    if changed and _older_forms_match(cfg, recorded, changed):
        write_atomic(path, json.dumps(current, indent=2))  # an older record of the same run
        return
    if changed:
        raise ConfigError(
            f"run_dir {cfg.run_dir} was started with another {' and '.join(changed)} "
            f"configuration{_what_changed(cfg, changed)} (see {path}): its SFT model and "
            "checkpoints do not belong to this config. Use a new run_dir, or delete that "
            "directory to start over.")


def check_checkpoints_model(cfg: ExperimentConfig) -> None:
    """For a command reading a run's checkpoints with ``cfg`` (``export``): refuse it when the
    run directory recorded another model or SFT setting: checkpoints of the same shape restore
    without an error, and the tokenizer, chat template and generation settings exported with
    them would be another model's (or, SFT settings changed, the SFT model looked for where
    there is none). The model is compared where its files still are. Nothing is written."""
    path = Path(cfg.run_dir) / FINGERPRINT_FILE
    if not path.is_file():  # a run started before fingerprints were kept
        return
    recorded = read_json(path)
    model_there = cfg.model_path == "tiny" or (base_model_path(cfg) / "config.json").is_file()
    parts = ["model", "sft"] if model_there else ["sft"]
    current = {part: _FINGERPRINT_PARTS[part](cfg) for part in parts}
    changed = [k for k in current if recorded.get(k) != current[k]]
    if changed and not _older_forms_match(cfg, recorded, changed):
        raise ConfigError(
            f"run_dir {cfg.run_dir} was trained with another {' and '.join(changed)} "
            f"configuration{_what_changed(cfg, changed)} (see {path}): its checkpoints do not "
            f"belong to this config. Give the run's own: --config "
            f"{Path(cfg.run_dir) / 'config.json'}")


def _older_forms_match(cfg: ExperimentConfig, recorded: dict, changed: list[str]) -> bool:
    """Whether every ``changed`` part of the ``recorded`` fingerprint is an older form of
    ``cfg``'s (the same run, recorded by an earlier version)."""
    return all(any(recorded.get(k) == form(cfg) for form in _OLDER_FORMS.get(k, ()))
               for k in changed)


# The settings each part of the fingerprint hashes (its files aside).
_PART_SETTINGS = {"model": ("model_path", "tiny"), "data": ("dataset", "synthetic"),
                  "sft": ("sft",)}


def _what_changed(cfg: ExperimentConfig, parts: list[str]) -> str:
    """What differs in ``parts`` from the config the run last started with (its
    ``config.json``): the settings, or, where they are the same, the files; empty without that
    record."""
    if _recorded_config(cfg) is None:
        return ""
    details = []
    for part in parts:
        found = changed_since_last_start(cfg, _PART_SETTINGS[part])
        if found:
            details += found
        elif part == "data":
            details.append(f"the contents of {dataset_config(cfg.dataset, cfg.run_dir).path}")
        elif part == "model":
            details.append(f"the model's files in {base_model_path(cfg)}")
    return ": " + "; ".join(details[:5]) + ("; ..." if len(details) > 5 else "")


def changed_since_last_start(cfg: ExperimentConfig, keys: Sequence[str] | None = None
                             ) -> list[str]:
    """Each setting under ``keys`` (default: all but ``run_dir``) that differs from the config
    the run directory last started with (``key.sub was X, now Y``); empty for a new one."""
    recorded = _recorded_config(cfg)
    if recorded is None:
        return []
    current = to_dict(cfg)
    for config in (recorded, current):  # no tiny section is the default one (older records)
        if config.get("tiny") is None:
            config["tiny"] = to_dict(TinyModelSpec())
    if keys is None:
        keys = sorted({*recorded, *current} - {"run_dir"})
    return [d for key in keys for d in _differences(key, recorded.get(key), current.get(key))]


def record_config(cfg: ExperimentConfig) -> None:
    """Keep ``cfg`` as the config the run directory last started with (``config.json``): what
    a later start's changed settings, and a refused one's, are named against."""
    write_atomic(Path(cfg.run_dir) / "config.json", json.dumps(to_dict(cfg), indent=2))


def _recorded_config(cfg: ExperimentConfig) -> dict | None:
    """The config the run directory last started with (its ``config.json``), or None where
    there is none or it does not read."""
    try:
        return read_json(Path(cfg.run_dir) / "config.json")
    except (ConfigError, OSError):
        return None


def _differences(key: str, before: Any, now: Any) -> list[str]:
    """``key.sub: was X, now Y`` for each setting under ``key`` that differs."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [d for k in sorted({*before, *now}, key=str)
                for d in _differences(f"{key}.{k}", before.get(k), now.get(k))]
    return [] if before == now else [f"{key} was {before!r}, now {now!r}"]
