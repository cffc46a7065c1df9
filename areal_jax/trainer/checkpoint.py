"""Orbax checkpoints of the train state plus a JSON dict, one per trainer version.

Each checkpoint holds the array tree (parameters, optimiser state, update count, RNG key) and
``meta``: a JSON-able dict (the trainer's version and what the controller owns, e.g. its data
position) plus checksums of the arrays. Restoring takes an abstract tree whose leaves carry the
target shardings, so a checkpoint written on one mesh restores onto any other.

A checkpoint that does not fit the trainer (other model or optimiser) raises
``CheckpointMismatchError``; one whose files are damaged (truncated, altered, missing) is
``CheckpointCorruptError``, and restoring the latest falls back to the newest intact one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from areal_jax.parallel.multihost import all_processes, same_on_all

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A checkpoint's parameters or optimiser state do not fit the restoring trainer."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files are damaged: truncated, altered or missing."""


_CHECKSUMS = "_array_checksums"  # meta key of the checksums written with the arrays
_META_CHECKSUM = "_meta_checksum"  # meta key of the checksum of the meta's other entries
_UINTS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class Checkpointer:
    """Keeps the newest ``keep`` checkpoints under ``directory``; saves asynchronously if asked.

    With several processes every process calls every method (each writes and reads its own
    shards; process 0 writes the shared metadata); ``directory`` must be shared by all.
    """

    def __init__(self, directory: str | Path, keep: int, async_save: bool = True,
                 meta_problem: Callable[[dict, int], str | None] | None = None):
        """``meta_problem(meta, step)``: what is wrong with a restored checkpoint's meta, or
        None; a checkpoint whose meta has a problem is damaged (a restore falls back)."""
        self._meta_problem = meta_problem
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # Restores read through the item handlers: unlike the manager they hold no cross-process
        # barrier, so a process that fails to read cannot leave the others waiting in one.
        self._state_reader = ocp.StandardCheckpointHandler()
        self._meta_reader = ocp.JsonCheckpointHandler()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write ``state`` (array pytree) and ``meta`` as checkpoint ``step``; replaces an
        existing checkpoint of the same step. Returns once arrays are copied off the device.

        Checksums of the arrays, and of the meta itself, go into the stored meta, so altered
        bytes are caught on restore.
        """
        try:
            meta = {**meta, _META_CHECKSUM: _meta_checksum(meta)}
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta must be JSON-serialisable: {e}") from e
        meta[_CHECKSUMS] = checksums(state)
        if step in self._manager.all_steps():
            self._manager.wait_until_finished()
            self._manager.delete(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) of checkpoint ``step``, or None if there is no checkpoint.

        Without ``step``: the newest intact checkpoint; damaged newer ones are skipped with a
        warning, and ``CheckpointCorruptError`` is raised when none is intact.
        ``abstract_state``: the saved tree's structure with ``jax.ShapeDtypeStruct`` leaves
        carrying the shardings to restore onto.
        """
        self._manager.wait_until_finished()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not same_on_all([len(steps), zlib.crc32(repr(steps).encode())]):
            raise CheckpointCorruptError(
                f"the trainer processes see different checkpoints in {self.directory} (this "
                f"one: {steps[::-1]}): run_dir must be on a filesystem every process shares")
        if step is not None:
            if step not in steps:
                raise ValueError(f"no checkpoint for step {step} in {self.directory}")
            return self._restore_step(abstract_state, step)
        self._remove_unfinished_saves()
        damaged = []
        for s in steps:
            try:
                restored = self._restore_step(abstract_state, s)
            except CheckpointCorruptError as e:
                log.warning("skipping damaged checkpoint %d: %s", s, e)
                damaged.append(e)
                continue
            if damaged:
                self._set_aside(steps[: len(damaged)])
            return restored
        if damaged:
            raise CheckpointCorruptError(
                f"no intact checkpoint in {self.directory} ({len(damaged)} damaged); "
                f"the newest: {damaged[0]}"
            ) from damaged[0]
        return None

    def _remove_unfinished_saves(self) -> None:
        """Delete the temporary directories of saves a killed (or disk-full) run never
        finished. Only when a run resumes: a read-only restore of a named step (an export
        beside a live run) must not touch a save in progress."""
        if jax.process_index() == 0:
            for path in self.directory.glob("*.orbax-checkpoint-tmp*"):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    log.warning("removed the unfinished checkpoint save %s", path)
        all_processes(True)

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged checkpoints newer than the restored one to ``<step>.damaged`` (then
        ``.damaged.1``, ... when the same step was damaged before): left in place they stay the
        manager's latest steps, and it would skip every save below them."""
        error = None
        if jax.process_index() == 0:
            try:
                for step in steps:
                    aside = self.directory / f"{step}.damaged"
                    n = 0
                    while aside.exists():
                        n += 1
                        aside = self.directory / f"{step}.damaged.{n}"
                    (self.directory / str(step)).rename(aside)
                    log.warning("moved damaged checkpoint %d aside to %s", step, aside)
            except OSError as e:
                error = e
        # Every process sees the renames before it rereads the steps, or fails with process 0.
        if not all_processes(error is None):
            raise CheckpointCorruptError(f"cannot move damaged checkpoints {steps} aside in "
                                         f"{self.directory}: {error or 'failed on process 0'}")
        self._manager.reload()

    def steps(self) -> list[int]:
        """Every checkpoint's step, ascending (after any pending save finishes)."""
        self._manager.wait_until_finished()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpoint's step (after any pending save finishes), or None."""
        self._manager.wait_until_finished()
        return self._manager.latest_step()

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.close()
        self._state_reader.close()
        self._meta_reader.close()

    def _restore_step(self, abstract_state: Any, step: int) -> tuple[Any, dict]:
        """Every process reads its shards; all of them fail together if any one fails."""
        where = f"checkpoint {step} in {self.directory}"
        step_dir = self.directory / str(step)  # the manager's default step naming
        error = self._fit_error(abstract_state, step_dir, where)
        if not all_processes(error is None):
            raise error or CheckpointCorruptError(f"{where} is damaged (read on another process)")
        try:
            state = self._state_reader.restore(
                step_dir / "state", args=ocp.args.StandardRestore(abstract_state)
            )
            meta = dict(self._meta_reader.restore(step_dir / "meta", args=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - the structure fits, so any failure is damage
            error = CheckpointCorruptError(f"{where} cannot be read: {_first_line(e)}")
            error.__cause__ = e
        if not all_processes(error is None):
            raise error or CheckpointCorruptError(f"{where} cannot be read on another process")
        expected = meta.pop(_CHECKSUMS, None)
        written = meta.pop(_META_CHECKSUM, None)  # none: written by an older version
        if written is not None and written != _meta_checksum(meta):
            raise CheckpointCorruptError(f"{where}: its metadata was altered (its checksum "
                                         "does not match)")
        problem = self._meta_problem(meta, step) if self._meta_problem else None
        if problem is not None:
            raise CheckpointCorruptError(f"{where}: its metadata {problem}")
        if expected is None:
            log.warning("%s was written without checksums (by an older version): its arrays "
                        "are not verified", where)
        elif not isinstance(expected, dict):
            raise CheckpointCorruptError(f"{where}: its metadata's {_CHECKSUMS} is a "
                                         f"{type(expected).__name__}, not a mapping")
        else:
            found = checksums(state)
            unlisted = sorted(found.keys() - expected.keys())
            if unlisted:
                more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
                raise CheckpointCorruptError(
                    f"{where}: its metadata holds no checksum for {', '.join(unlisted[:3])}"
                    f"{more}: not the metadata written with these arrays")
            altered = [name for name in expected if found.get(name) != expected[name]]
            if altered:
                more = f" and {len(altered) - 3} more arrays" if len(altered) > 3 else ""
                raise CheckpointCorruptError(
                    f"{where} holds altered data: the checksums written with "
                    f"{', '.join(altered[:3])}{more} do not match"
                )
        return state, meta

    def _fit_error(self, abstract_state: Any, step_dir: Path, where: str) -> ValueError | None:
        """Why ``abstract_state`` cannot take the checkpoint (from its metadata), or None."""
        try:
            leaves = jax.tree.leaves(self._state_reader.metadata(step_dir / "state"))
            saved = {leaf.name: tuple(leaf.shape) for leaf in leaves}
        except Exception as e:  # noqa: BLE001 - unreadable metadata is damage
            return CheckpointCorruptError(f"{where}: its array metadata cannot be read: "
                                          f"{_first_line(e)}")  # fmt: skip
        wanted = {_name(path): tuple(x.shape) for path, x in _flat(abstract_state)}
        if saved == wanted:
            return None
        diff = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
        details = "; ".join(f"{k}: saved {saved.get(k)}, here {wanted.get(k)}" for k in diff[:3])
        return CheckpointMismatchError(
            f"{where} does not fit this trainer: it was saved with another model or optimiser "
            f"configuration (model size, grad_clip, weight decay, ...). Restore with the "
            f"configuration it was saved with, or use a new run_dir. Differences: {details}"
        )


def _meta_checksum(meta: dict) -> str:
    """SHA-256 of ``meta`` as canonical JSON (what the restore reads back compares equal)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def checksums(tree: Any) -> dict[str, list[int]]:
    """Two uint32 checksums per array of ``tree`` (plain and position-weighted sums of the bits),
    computed on the devices; keys are the arrays' dotted paths."""
    sums = jax.device_get(_device_checksums(tree))
    return {_name(path): [int(v) for v in s] for path, s in _flat(sums)}


def compile_checksums(abstract_state: Any) -> None:
    """Compile the checksum program ``Checkpointer.save`` runs on a state shaped like
    ``abstract_state`` (ShapeDtypeStructs with shardings), so the first save does not."""
    _device_checksums.lower(abstract_state).compile()


@jax.jit
def _device_checksums(tree):
    def one(x):
        if x.dtype.itemsize not in _UINTS:
            raise TypeError(f"no checksum for {x.dtype} arrays")
        bits = jax.lax.bitcast_convert_type(x, _UINTS[x.dtype.itemsize]).astype(jnp.uint32)
        index = jnp.ones(x.shape, jnp.uint32)
        stride = 1
        for d in reversed(range(x.ndim)):
            index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
            stride *= x.shape[d]
        return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * index, dtype=jnp.uint32)])

    return jax.tree.map(one, tree)


def _flat(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _name(path) -> str:
    """Orbax's name of an array: its key path joined by dots (``params.embed.value``)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def _first_line(e: BaseException) -> str:
    """The first line of the innermost cause (Orbax wraps the TensorStore error that names the
    file)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def abstract_like(tree: Any) -> Any:
    """``tree`` with every array replaced by a ShapeDtypeStruct keeping its sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
