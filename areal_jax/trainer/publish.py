"""Publishing a policy version: an atomic Hugging Face export per version, old ones pruned.

Exports live in ``<exports_dir>/v{version:06d}``; rollout servers load them by path. A
directory only appears once complete (the export writes a temporary sibling and renames).
Publishing can be split: ``hf_state_dict`` snapshots the parameters to host arrays on the
training thread, and ``publish_tensors`` writes and prunes on another thread. An export this
process is sending to a server or copying (``export_in_use``) is not pruned meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from areal_jax.models import ModelConfig, Transformer, export_hf_tensors, hf_state_dict
from areal_jax.models.hf_export import remove_unfinished_exports

_EXPORT_NAME = re.compile(r"v(\d{6,})")
_in_use: collections.Counter[str] = collections.Counter()  # resolved export path -> holders
_in_use_lock = threading.Lock()  # also held by prune_exports while it picks and renames
_PRUNED_PREFIX = ".pruned-"  # an export being deleted


def export_path(exports_dir: str | Path, version: int) -> Path:
    """Where version ``version`` is exported."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return Path(exports_dir) / f"v{version:06d}"


def publish_tensors(
    tensors: dict[str, np.ndarray],
    cfg: ModelConfig,
    exports_dir: str | Path,
    version: int,
    *,
    keep: int,
    keep_every: int = 0,
    tokenizer_dir: str | Path | None = None,
    source_dir: str | Path | None = None,
) -> Path:
    """Write host ``tensors`` (from ``hf_state_dict``) as ``version`` (with tokenizer files if
    ``tokenizer_dir``, and the generation config of ``source_dir`` if it has one), then prune as
    ``prune_exports(exports_dir, keep, keep_every)``; the export just written is never pruned.
    Touches no device: safe on a background thread.

    The files are not synced to disk (the rename still makes them appear whole): a published
    version only has to outlive the process, a restart publishes its version again from the
    checkpoint, and a load checks every file's size and values. Syncing was about half of the
    write time of a 100 MB export."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    out = export_hf_tensors(tensors, cfg, export_path(exports_dir, version),
                            tokenizer_dir=tokenizer_dir, source_dir=source_dir, durable=False)
    prune_exports(exports_dir, keep, protect=out, keep_every=keep_every)
    return out


def publish_version(
    model: Transformer,
    exports_dir: str | Path,
    version: int,
    *,
    keep: int,
    dtype="float32",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """``publish_tensors(hf_state_dict(model, dtype), model.cfg, ...)`` in one call."""
    return publish_tensors(hf_state_dict(model, dtype), model.cfg, exports_dir, version,
                           keep=keep, tokenizer_dir=tokenizer_dir)


def list_exports(exports_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete version exports under ``exports_dir`` as (version, path), oldest first."""
    exports = []
    for path in Path(exports_dir).iterdir():
        match = _EXPORT_NAME.fullmatch(path.name)
        if match and path.is_dir():
            exports.append((int(match.group(1)), path))
    return sorted(exports)


def discard_exports_after(exports_dir: str | Path, version: int) -> list[Path]:
    """Delete the exports of versions above ``version``: a run resumed from the checkpoint at
    ``version`` discards what the interrupted run trained after it (a server restarted on the
    newest export would otherwise serve weights of the discarded run), and the unfinished
    exports a killed run left; returns the paths of the versions deleted."""
    if not Path(exports_dir).is_dir():
        return []
    remove_unfinished_exports(exports_dir)  # of versions a killed run was writing
    doomed = [p for v, p in list_exports(exports_dir) if v > version]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def prune_exports(
    exports_dir: str | Path, keep: int, protect: Path | None = None, keep_every: int = 0
) -> list[Path]:
    """Delete version exports beyond the ``keep`` highest, except ``protect``, those in use
    (``export_in_use``) and, with ``keep_every`` > 0, the versions that are multiples of it
    (kept for an accuracy curve after the run, see ``areal-jax eval --curve``); returns the
    deleted paths."""
    with _in_use_lock:  # only renames under it: a pin taken on the event loop never waits long
        doomed = [p for v, p in list_exports(exports_dir)[:-keep]
                  if p != protect and not (keep_every and v % keep_every == 0)
                  and not _in_use[str(p.resolve())]]
        for path in doomed:
            with contextlib.suppress(OSError):  # left for the next prune
                os.rename(path, path.with_name(f"{_PRUNED_PREFIX}{path.name}-{uuid.uuid4().hex}"))
    for path in Path(exports_dir).glob(_PRUNED_PREFIX + "*"):  # a killed process's too
        shutil.rmtree(path, ignore_errors=True)
    return doomed


@contextlib.contextmanager
def export_in_use(path: str | Path) -> Iterator[Path]:
    """While the block runs, ``prune_exports`` (in this process) leaves the directory ``path``
    alone: a server is loading it, or it is being copied. Raises ``FileNotFoundError`` when it
    is gone already (pruned: a newer version was published)."""
    key = str(Path(path).resolve())
    with _in_use_lock:
        if not os.path.isdir(key):
            raise FileNotFoundError(f"{path} is gone (pruned after a newer version?)")
        _in_use[key] += 1
    try:
        yield Path(path)
    finally:
        with _in_use_lock:
            _in_use[key] -= 1
            if not _in_use[key]:
                del _in_use[key]


RESTART_COPY_PREFIX = ".restart-"  # never listed as an export, never pruned


def link_newest_export(exports_dir: str | Path, name: str) -> tuple[int, Path] | None:
    """(version, copy) of the newest export in ``exports_dir``, its files hard-linked (copied
    across filesystems) into ``exports_dir/.restart-<name>`` (replacing what was there), which
    pruning never touches: for a server that may take longer to read it than the run takes to
    publish two more versions (a sibling of the exports, so that the server's default
    ``weights_allowed_roots``, its checkpoint's directory, is still the exports directory).
    One name per server keeps one copy per server: its previous one is no longer read once it
    is restarted. None when there is no export. ``remove_restart_copies`` deletes them."""
    copy = Path(exports_dir) / f"{RESTART_COPY_PREFIX}{name}"
    while exports := list_exports(exports_dir):
        version, path = exports[-1]
        with contextlib.ExitStack() as pinned:
            try:
                pinned.enter_context(export_in_use(path))
            except FileNotFoundError:
                continue  # pruned meanwhile: a newer one is there
            partial = copy.with_name(copy.name + ".partial")
            for stale in (partial, copy):
                shutil.rmtree(stale, ignore_errors=True)
            shutil.copytree(path, partial, copy_function=_link_or_copy)
            partial.rename(copy)
        return version, copy
    return None


def remove_restart_copies(exports_dir: str | Path) -> None:
    """Delete what ``link_newest_export`` made in ``exports_dir``."""
    for path in Path(exports_dir).glob(RESTART_COPY_PREFIX + "*"):
        shutil.rmtree(path, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)
