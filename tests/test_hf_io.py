"""Hugging Face import/export: round trips, exact dtypes, sharded files, clear errors."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_jax.models import CheckpointError, ModelConfig, ModelConfigError, export_hf, load_hf_model
from areal_jax.models.hf_export import ExportTargetError
from areal_jax.models.safetensors_io import SafetensorsFile

from _hf_models import hf_logits, hf_model, save_hf_model


def _load_torch(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type,tie", [("qwen2", True), ("qwen3", False), ("llama", False)])
def test_import_export_reload_gives_same_logits(tmp_path, model_type, tie):
    ref = hf_model(model_type, tie=tie, seed=21)
    save_hf_model(ref, tmp_path / "src")
    model, _ = load_hf_model(tmp_path / "src")
    export_hf(model, tmp_path / "out")
    reloaded = _load_torch(tmp_path / "out")
    tokens = np.random.RandomState(3).randint(0, 97, size=(2, 20))
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(ref, tokens), atol=1e-5, rtol=0)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert "eos_token_id" in gen


def test_export_reproduces_every_tensor_exactly_in_source_dtype(tmp_path):
    ref = hf_model("qwen2", seed=4)
    save_hf_model(ref, tmp_path / "src", dtype=torch.bfloat16)
    model, dtypes = load_hf_model(tmp_path / "src")
    assert set(np.dtype(d) for d in dtypes.values()) == {np.dtype(ml_dtypes.bfloat16)}
    export_hf(model, tmp_path / "out", dtype={k: "BF16" for k in dtypes},
              max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    src = SafetensorsFile(tmp_path / "src" / "model.safetensors")
    assert sorted(index["weight_map"]) == sorted(src.keys())
    for name, fname in index["weight_map"].items():
        out = SafetensorsFile(tmp_path / "out" / fname)
        assert out.dtype(name) == src.dtype(name), name
        np.testing.assert_array_equal(out.get(name).view(np.uint16), src.get(name).view(np.uint16))
    # The sharded export loads in transformers.
    reloaded = _load_torch(tmp_path / "out")
    tokens = np.random.RandomState(0).randint(0, 97, size=(1, 12))
    ref_bf16 = _load_torch(tmp_path / "src")
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(ref_bf16, tokens), atol=1e-5)


def test_layers_saved_in_bfloat16_and_float16_load_as_transformers_loads_them(tmp_path):
    # numpy does not promote bfloat16 with float16: a DTypePromotionError naming no tensor.
    from areal_jax.models.safetensors_io import save_safetensors

    ref = hf_model("qwen2", seed=5)
    save_hf_model(ref, tmp_path / "mixed", dtype=torch.bfloat16)
    path = tmp_path / "mixed" / "model.safetensors"
    tensors = {name: np.array(SafetensorsFile(path).get(name))
               for name in SafetensorsFile(path).keys()}
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(np.float16)
    save_safetensors(path, tensors)
    assert SafetensorsFile(path).dtype(name) == np.float16
    model, _ = load_hf_model(tmp_path / "mixed")
    export_hf(model, tmp_path / "out")
    tokens = np.random.RandomState(1).randint(0, 97, size=(1, 12))
    np.testing.assert_allclose(hf_logits(_load_torch(tmp_path / "out"), tokens),
                               hf_logits(_load_torch(tmp_path / "mixed"), tokens), atol=1e-5)


def test_export_replaces_an_earlier_export_atomically_and_nothing_else(tmp_path):
    model, _ = load_hf_model(save_hf_model(hf_model("llama", seed=1), tmp_path / "src"))
    export_hf(model, tmp_path / "out", max_shard_bytes=20_000)  # an earlier, sharded export
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    export_hf(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]  # no stale shard left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp dirs left
    # A directory holding anything but a model's files (a run directory, a home directory) is
    # refused and left as it was: the export would have replaced it whole.
    for extra in ("notes.txt", "checkpoints/"):
        target = tmp_path / f"keep-{extra.strip('/')}"
        target.mkdir()
        (target / "config.json").write_text("{}")
        if extra.endswith("/"):
            (target / extra).mkdir()
        else:
            (target / extra).write_text("mine")
        with pytest.raises(ExportTargetError, match=f"holds '{extra.strip('/')}'"):
            export_hf(model, target)
        assert sorted(p.name for p in target.iterdir()) == sorted(["config.json", extra.strip("/")])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportTargetError, match="is not a directory"):
        export_hf(model, tmp_path / "file")
    (tmp_path / "link").symlink_to(tmp_path / "out")
    with pytest.raises(ExportTargetError, match="is a symbolic link; .* give the link's target"):
        export_hf(model, tmp_path / "link")


def test_list_of_eos_ids_is_kept_hashable_and_round_trips():
    """Llama 3.1 style ``eos_token_id: [..]``: the config (part of jit cache keys) stays hashable."""
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": [7, 8, 9]}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.eos_token_ids == (7, 8, 9) and hash(cfg) == hash(ModelConfig.from_hf_dict(hf))
    assert cfg.to_hf_dict()["eos_token_id"] == [7, 8, 9]


def test_rope_settings_resolve_like_transformers_and_round_trip():
    """``rope_theta`` inside the chosen dict wins over the top-level one; an exported config
    reads back to the same settings."""
    base = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}
    cfg = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e4, None)
    yarn = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 64}})
    assert yarn.rope_theta == 5e5 and dict(yarn.rope_scaling.params) == {
        "factor": 4.0, "original_max_position_embeddings": 64}  # factor inferred: 256 / 64
    assert ModelConfig.from_hf_dict(yarn.to_hf_dict()) == yarn


def test_unknown_model_type_and_missing_field_are_named():
    base = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ModelConfigError, match=r"model_type 'gpt2' is not supported; supported: qwen2, qwen3, llama"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    missing = dict(base)
    del missing["intermediate_size"]
    with pytest.raises(ModelConfigError, match="missing field 'intermediate_size'"):
        ModelConfig.from_hf_dict(missing)
    with pytest.raises(ModelConfigError, match=r"rope_scaling.rope_type 'dynamic' is not "
                       r"supported; supported: default, linear, llama3, yarn"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default"},
                                  "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="rope_parameters.rope_type 'longrope'"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "longrope"}})
    with pytest.raises(ModelConfigError, match="rope_scaling of rope_type llama3 is missing "
                                               "'low_freq_factor'"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}})
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 3, "num_attention_heads": 4})


def test_config_values_of_the_wrong_type_or_range_are_named(tmp_path):
    # Each of these loaded and gave non-finite logits, a silently truncated layer count, an
    # EOS that never ends a generation, or a raw ZeroDivisionError / AttributeError.
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    for change, message in (
            ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be finite, got nan"),
            ({"rms_norm_eps": -1.0}, "rms_norm_eps must be > 0, got -1.0"),
            ({"rope_theta": -5}, "rope_theta must be > 1, got -5"),
            ({"rope_parameters": {"rope_type": "linear", "factor": 0}},
             "rope_parameters.factor must be > 0, got 0"),
            ({"rope_scaling": {**llama3, "high_freq_factor": 1.0}},
             "low_freq_factor and high_freq_factor must differ"),
            ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 0}},
             "rope_scaling.original_max_position_embeddings must be a positive integer, got 0"),
            ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64,
                               "truncate": "no"}}, "rope_scaling.truncate must be true or false"),
            ({"num_hidden_layers": 2.7}, "num_hidden_layers must be a positive integer, got 2.7"),
            ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
            ({"hidden_size": "8"}, "hidden_size must be a number, got '8'"),
            ({"max_position_embeddings": 10**400}, "max_position_embeddings must be finite"),
            ({"eos_token_id": "2"}, "eos_token_id must hold non-negative integer ids below "
                                    "vocab_size 10, got '2'"),
            ({"eos_token_id": [2, 10]}, "eos_token_id must hold"),
            ({"pad_token_id": -2}, "pad_token_id must hold non-negative integer ids, got -2")):
        with pytest.raises(ModelConfigError, match=re.escape(message)):
            ModelConfig.from_hf_dict({**base, **change})
    # An integral float is an integer; an EOS list stays a tuple.
    cfg = ModelConfig.from_hf_dict({**base, "num_hidden_layers": 2.0, "eos_token_id": [1, 9],
                                    "pad_token_id": -1})  # -1: none, in older Llama configs
    assert (cfg.num_layers, cfg.eos_token_ids, cfg.pad_token_id) == (2, (1, 9), None)
    for text, message in (("[1, 2]", "must hold a JSON object, got list"),
                          ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
                          (b"\xff{}", "is not valid JSON")):
        (tmp_path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ModelConfigError, match=message):
            ModelConfig.from_pretrained(tmp_path)


def test_missing_truncated_and_incomplete_weights_fail_clearly(tmp_path):
    src = save_hf_model(hf_model("qwen2", seed=2), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()

    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated: tensor"):
        load_hf_model(src)

    weights.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_model(src)

    weights.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_model(src)

    # A checkpoint whose config promises more layers than the file holds names the tensor.
    save_hf_model(hf_model("qwen2", seed=2), tmp_path / "m2")
    cfg = json.loads((tmp_path / "m2" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "m2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.2."):
        load_hf_model(tmp_path / "m2")
    # A billion layers: the expected names were built first (13.9 GB in a minute, then killed).
    (tmp_path / "m2" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))
    with pytest.raises(CheckpointError, match=r"missing tensor model.layers.2.\*: config.json "
                                              r"has num_hidden_layers 1000000000, and the weights "
                                              r"hold 2 layers"):
        load_hf_model(tmp_path / "m2")

    with pytest.raises(ModelConfigError, match="no config.json"):
        load_hf_model(tmp_path / "nowhere")


def test_attention_break_even_by_hand():
    """(d(q + 2kv) + qd + 3df) / q = (256*512 + 256*256 + 3*256*768) / 256 = 3072."""
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4})
    assert cfg.attention_break_even == 3072
