"""Orbax checkpoints: exact resume, restore onto another mesh, keep-N, damage, errors."""

import json
import logging
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.parallel import MeshConfig, make_mesh
from areal_jax.rl import MicroBatchConfig
from areal_jax.trainer import (
    CheckpointCorruptError, CheckpointMismatchError, Checkpointer, Trainer, TrainerConfig,
)  # fmt: skip

from _trainer_kit import (
    assert_params_close, checkpoint_array_files, host_params, tiny_model, toy_groups,
    truncate_checkpoint,
)  # fmt: skip


def _config(run_dir):
    return TrainerConfig(run_dir=str(run_dir), lr=1e-2, ppo_n_minibatches=2, checkpoint_keep=2,
                         micro_batch=MicroBatchConfig(token_budget=64, row_buckets=(64,)))


def test_resume_gives_the_same_next_step_on_the_same_and_on_another_mesh(tmp_path):
    model = tiny_model(seed=21)
    batches = [toy_groups(seed=s, n_groups=2, group_size=4) for s in range(3)]
    trainer = Trainer(_config(tmp_path), mesh=make_mesh(MeshConfig(fsdp=8)), model=model)
    trainer.train_on_batch(batches[0])
    trainer.save({"data_position": 17, "note": "after one step"})
    saved = host_params(trainer)
    m1 = trainer.train_on_batch(batches[1])  # donates the saved arrays while the save runs
    after = host_params(trainer)

    assert trainer.restore() == {"data_position": 17, "note": "after one step"}
    assert trainer.version == 1
    assert_params_close(host_params(trainer), saved, atol=0)
    again = trainer.train_on_batch(batches[1])
    assert_params_close(host_params(trainer), after, atol=0)
    assert again["loss"] == m1["loss"]

    other = Trainer(_config(tmp_path), mesh=make_mesh(MeshConfig(fsdp=2, tensor=4)),
                    model=tiny_model(seed=99))
    assert other.restore() == {"data_position": 17, "note": "after one step"}
    gate = other.model.layers.gate_kernel[...]
    assert gate.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert_params_close(host_params(other), saved, atol=0)
    m2 = other.train_on_batch(batches[1])
    assert other.version == 2
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    assert_params_close(host_params(other), after, atol=1e-5)
    trainer.close()
    other.close()


def test_checkpointer_keeps_the_newest_n_and_replaces_a_step(tmp_path):
    mesh = make_mesh(MeshConfig(fsdp=8))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, async_save=True)
    assert ckpt.latest_step() is None
    assert ckpt.restore({"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)}) is None
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jax.device_put(jnp.full(8, float(step)), sharding)}, {"step": step})
    ckpt.save(3, {"w": jax.device_put(jnp.arange(8.0), sharding)}, {"step": 3, "again": True})
    assert ckpt.latest_step() == 3
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [2, 3]

    replicated = NamedSharding(mesh, PartitionSpec())
    target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=replicated)}
    state, meta = ckpt.restore(target)
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(8.0))
    assert meta == {"step": 3, "again": True}
    assert state["w"].sharding.spec == PartitionSpec()
    state, meta = ckpt.restore(target, step=2)
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full(8, 2.0))
    with pytest.raises(ValueError, match="no checkpoint for step 1"):
        ckpt.restore(target, step=1)
    with pytest.raises(ValueError, match="meta must be JSON-serialisable"):
        ckpt.save(4, {"w": state["w"]}, {"bad": object()})
    mismatches = {
        "shape": {"w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=replicated)},
        "structure": {"w": target["w"], "extra": target["w"]},
    }
    for name, wrong in mismatches.items():
        with pytest.raises(CheckpointMismatchError,
                           match=r"checkpoint 3 in .* does not fit this trainer"):
            ckpt.restore(wrong)
    ckpt.close()


def _flip_bytes(step_dir):
    for path in checkpoint_array_files(step_dir):
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 4):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))


def _swap_arrays(step_dir):
    """Readable arrays that are not the ones saved here: checkpoint 1's, under 2's meta."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "1" / "state", step_dir / "state")


def _delete_item(step_dir):
    shutil.rmtree(step_dir / "state")


def _meta_without_version(step_dir):
    """As a meta written before the meta's own checksum, without a version."""
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    del meta["version"], meta["_meta_checksum"]
    (step_dir / "meta" / "metadata").write_text(json.dumps(meta))


def _meta_extra_altered(step_dir):
    """The controller's state altered, still valid JSON: it reached the loop unchecked."""
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    meta["extra"]["data_position"] = 7
    (step_dir / "meta" / "metadata").write_text(json.dumps(meta))


def _meta_missing_a_checksum(step_dir):
    """The checksum of one array dropped: the array went unchecked."""
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    del meta["_array_checksums"][min(meta["_array_checksums"])]
    (step_dir / "meta" / "metadata").write_text(json.dumps(meta))


def _meta_checksums_not_a_mapping(step_dir):
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    (step_dir / "meta" / "metadata").write_text(json.dumps({**meta, "_array_checksums": []}))


def _meta_of_another_version(step_dir):
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    (step_dir / "meta" / "metadata").write_text(json.dumps({**meta, "version": 1 << 40}))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run directory with checkpoints 1 and 2, and the parameters saved at 1."""
    run_dir = tmp_path_factory.mktemp("two_checkpoints")
    trainer = Trainer(_config(run_dir), mesh=make_mesh(MeshConfig(fsdp=8)), model=tiny_model(3))
    trainer.train_on_batch(toy_groups(seed=0, n_groups=2, group_size=4))
    trainer.save({"data_position": 1})
    at_one = host_params(trainer)
    trainer.train_on_batch(toy_groups(seed=1, n_groups=2, group_size=4))
    trainer.save({"data_position": 2})
    trainer.close()
    return run_dir, at_one


@pytest.mark.parametrize("damage, reason", [
    (truncate_checkpoint, "cannot be read"),
    (_flip_bytes, "(cannot be read|holds altered data)"),  # altered data where bytes stay decodable
    (_swap_arrays, r"holds altered data: the checksums written with opt_state\.1\.0\.count, "),
    (_delete_item, "its array metadata cannot be read"),
    (_meta_missing_a_checksum, "its metadata holds no checksum for .*: not the metadata "
                               "written with these arrays"),
    # an AttributeError, not a damaged checkpoint: no fallback
    (_meta_checksums_not_a_mapping, "its metadata's _array_checksums is a list, not a mapping"),
    # a KeyError traceback, and a version the servers refused as out of range
    (_meta_without_version, "its metadata names version None, not the step's 2"),
    (_meta_of_another_version, "its metadata was altered"),
    (_meta_extra_altered, "its metadata was altered"),
])  # fmt: skip
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path, caplog, two_checkpoints, damage, reason
):
    pristine, at_one = two_checkpoints
    shutil.copytree(pristine / "checkpoints", tmp_path / "checkpoints")
    damage(tmp_path / "checkpoints" / "2")
    # A save a killed (or disk-full) run never finished: kept by a read-only restore of a
    # named step (an export beside a live run), removed when a run resumes.
    unfinished = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "checkpoints" / "1", unfinished)

    trainer = Trainer(_config(tmp_path), mesh=make_mesh(MeshConfig(fsdp=8)), model=tiny_model(4))
    assert trainer.restore(1) == {"data_position": 1} and unfinished.is_dir()
    with caplog.at_level(logging.WARNING, logger="areal_jax.trainer.checkpoint"):
        assert trainer.restore() == {"data_position": 1}
    assert not unfinished.exists()
    assert trainer.version == 1
    assert_params_close(host_params(trainer), at_one, atol=0)
    assert re.search(rf"skipping damaged checkpoint 2: checkpoint 2 in .*{reason}", caplog.text)
    assert "does not fit" not in caplog.text
    # Moved aside: left as the newest step, it made the manager skip every later save below it.
    assert (tmp_path / "checkpoints" / "2.damaged").is_dir()
    with pytest.raises(ValueError, match="no checkpoint for step 2"):
        trainer.restore(2)
    trainer.save({"data_position": 10})  # below the damaged step: the manager skipped it
    assert trainer.restore() == {"data_position": 10} and trainer.version == 1
    trainer.train_on_batch(toy_groups(seed=1, n_groups=2, group_size=4))
    trainer.save({"data_position": 2})
    assert trainer.restore() == {"data_position": 2} and trainer.version == 2
    # The same step damaged again: its first copy aside stays, and the restore still falls
    # back (the rename onto `2.damaged` failed, and the intact step was never restored).
    truncate_checkpoint(tmp_path / "checkpoints" / "2")
    assert trainer.restore() == {"data_position": 10} and trainer.version == 1
    assert (tmp_path / "checkpoints" / "2.damaged.1").is_dir()
    trainer.train_on_batch(toy_groups(seed=1, n_groups=2, group_size=4))
    trainer.save({"data_position": 2})
    assert trainer.restore() == {"data_position": 2}  # (waits for the asynchronous save)

    for step in ("1", "2"):
        truncate_checkpoint(tmp_path / "checkpoints" / step)
    with pytest.raises(CheckpointCorruptError, match=r"no intact checkpoint in .* \(2 damaged\)"):
        trainer.restore()
    trainer.close()
