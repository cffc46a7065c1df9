"""Mesh construction, the rules table, and sharded forward == single-device forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from areal_jax.models import load_hf_model
from areal_jax.parallel import MeshConfig, logical_to_spec, make_mesh

from _hf_models import hf_model, save_hf_model


def test_mesh_resolves_free_axis_and_rejects_bad_shapes():
    assert MeshConfig(data=1, fsdp=-1, tensor=4).resolve(8) == (1, 2, 4)
    assert MeshConfig(data=2, fsdp=2, tensor=2).resolve(8) == (2, 2, 2)
    with pytest.raises(ValueError, match="only one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1).resolve(8)
    with pytest.raises(ValueError, match="cannot be split"):
        MeshConfig(data=3, fsdp=-1).resolve(8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)
    with pytest.raises(ValueError, match="mesh.tensor"):
        MeshConfig(tensor=0).resolve(8)


def test_rules_replicate_indivisible_dims_and_use_each_axis_once():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    assert logical_to_spec(("embed", "mlp"), (32, 48), mesh) == P("fsdp", "tensor")
    # 2 kv heads cannot split 4 ways: replicated.
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("layers", "norm"), (2, 32), mesh) == P(None, None)
    with pytest.raises(KeyError, match="no sharding rule"):
        logical_to_spec(("bogus",), (4,), mesh)


def test_sharded_forward_equals_single_device(tmp_path):
    assert len(jax.devices()) == 8
    ref_model = hf_model("qwen2", seed=11, num_attention_heads=8, num_key_value_heads=4,
                         hidden_size=64, intermediate_size=96, vocab_size=96)
    save_hf_model(ref_model, tmp_path)
    single, _ = load_hf_model(tmp_path)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    sharded, _ = load_hf_model(tmp_path, mesh=mesh)

    gate = sharded.layers.gate_kernel[...]
    assert gate.sharding.spec == P(None, "fsdp", "tensor")
    shard_shapes = {s.data.shape for s in gate.addressable_shards}
    assert shard_shapes == {(2, 32, 24)}  # [L, D/2, F/4]
    q = sharded.layers.q_kernel[...]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 2, 8)}
    assert sharded.lm_head[...].sharding.spec == P("fsdp", "tensor")

    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 96, size=(4, 16)))
    seg = jnp.ones_like(tokens)
    pos = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    ref = np.asarray(single.forward_logits(tokens, seg, pos))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda t, s, p: sharded.forward_logits(t, s, p))(tokens, seg, pos)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


def test_init_model_creates_parameters_on_their_shardings():
    from areal_jax.models import ModelConfig, init_model

    cfg = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                    "intermediate_size": 64, "num_hidden_layers": 3,
                                    "num_attention_heads": 4, "num_key_value_heads": 4})
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    model = init_model(cfg, mesh, seed=1)
    down = model.layers.down_kernel[...]
    assert down.sharding.spec == P(None, "tensor", "fsdp")
    assert {s.data.shape for s in down.addressable_shards} == {(3, 16, 16)}
    # Same seed on one device gives the same values.
    single = init_model(cfg, seed=1)
    np.testing.assert_array_equal(np.asarray(down), np.asarray(single.layers.down_kernel[...]))
