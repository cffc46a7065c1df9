"""Orbax checkpoints of the train state plus a JSON dict, one per trainer version.

Each checkpoint holds the array tree (parameters, optimiser state, update count, RNG key) and
``meta``: a JSON-able dict (the trainer's version and what the controller owns, e.g. its data
position). Restoring takes an abstract tree whose leaves carry the target shardings, so a
checkpoint written on one mesh restores onto any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
    """A checkpoint's parameters or optimiser state do not fit the restoring trainer."""


class Checkpointer:
    """Keeps the newest ``keep`` checkpoints under ``directory``; saves asynchronously if asked."""

    def __init__(self, directory: str | Path, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write ``state`` (array pytree) and ``meta`` as checkpoint ``step``; replaces an
        existing checkpoint of the same step. Returns once arrays are copied off the device."""
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta must be JSON-serialisable: {e}") from e
        if step in self._manager.all_steps():
            self._manager.wait_until_finished()
            self._manager.delete(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) of checkpoint ``step`` (default: the latest), or None if there is none.

        ``abstract_state``: the saved tree's structure with ``jax.ShapeDtypeStruct`` leaves
        carrying the shardings to restore onto.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        self._manager.wait_until_finished()
        if step not in self._manager.all_steps():
            raise ValueError(f"no checkpoint for step {step} in {self.directory}")
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                ),
            )
        except ValueError as e:  # Orbax: tree structure or array shapes differ
            raise CheckpointMismatchError(
                f"checkpoint {step} in {self.directory} does not fit this trainer: it was saved "
                f"with another model or optimiser configuration (model size, grad_clip, "
                f"weight decay, ...). Restore with the configuration it was saved with, or use "
                f"a new run_dir. Details: {e}"
            ) from e
        return out.state, out.meta

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


def abstract_like(tree: Any) -> Any:
    """``tree`` with every array replaced by a ShapeDtypeStruct keeping its sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
