"""Tiny models and toy trajectory batches for the trainer tests.

The model has every tensor randomised (norm scales around 1, biases non-zero), so a bug in any
of them changes the numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import ModelConfig, abstract_model
from areal_jax.trajectory import Trajectory, TrajectoryGroup

VOCAB = 97


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False})  # fmt: skip


def tiny_model(seed: int = 0):
    """A tiny Qwen2 with all parameters drawn at random (scale 0.2 around 0, or 1 for norms)."""
    graphdef, abstract = nnx.split(abstract_model(tiny_config()))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    rng = np.random.RandomState(seed)
    values = []
    for path, leaf in flat:
        noise = 0.2 * rng.randn(*leaf.shape).astype(np.float32)
        values.append(jnp.asarray(noise + 1.0 if "norm" in jax.tree_util.keystr(path) else noise))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


def toy_groups(
    seed: int, n_groups: int = 3, group_size: int = 4, version: int = 0, max_output: int = 10
) -> list[TrajectoryGroup]:
    """Random prompts/outputs, rewards 0/1 alternating within each group, rough behaviour
    log-probs near log(1/V)."""
    rng = np.random.RandomState(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for k in range(group_size):
            prompt = rng.randint(0, VOCAB, size=rng.randint(2, 7))
            out = rng.randint(0, VOCAB, size=rng.randint(2, max_output + 1))
            behav = np.log(1.0 / VOCAB) + 0.3 * rng.randn(len(out))
            trajs.append(Trajectory(prompt, out, behav, np.full(len(out), version),
                                    reward=float((k + g) % 2)))
        groups.append(TrajectoryGroup(f"g{g}", trajs))
    return groups


def set_on_policy(trainer, groups) -> None:
    """Give every trajectory the trainer's current log-probs as behaviour log-probs."""
    trajs = [t for g in groups for t in g.trajectories]
    for t, logp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.behav_logprobs = logp


def host_params(trainer) -> dict[str, np.ndarray]:
    """The trainer's parameters as host arrays by path."""
    return model_params(trainer.model)


def model_params(model) -> dict[str, np.ndarray]:
    """A model's parameters as host arrays by path."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=0, err_msg=k)


def one_device_mesh():
    from areal_jax.parallel import MeshConfig, make_mesh

    return make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])


def checkpoint_array_files(step_dir) -> list:
    """Every data file of a checkpoint's arrays (Orbax leaves some unreferenced: damage all)."""
    return [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def truncate_checkpoint(step_dir) -> None:
    """Cut every array data file of a checkpoint in half."""
    for path in checkpoint_array_files(step_dir):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
