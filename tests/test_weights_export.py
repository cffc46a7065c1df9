"""Exports: the declared dtype is the written one, dtype names, and the two-step publish path."""

import json
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from _hf_models import hf_logits, hf_model, save_hf_model
from _trainer_kit import one_device_mesh
from areal_jax.models import (
    CheckpointError, ModelConfig, export_hf, export_hf_tensors, hf_state_dict, init_model,
    load_hf_model,
)  # fmt: skip
from areal_jax.models.safetensors_io import SafetensorsFile
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.publish import publish_tensors, publish_version


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    ref = hf_model("qwen3", seed=14)
    model, dtypes = load_hf_model(save_hf_model(ref, tmp_path_factory.mktemp("src")))
    return ref, model, dtypes


@pytest.mark.parametrize("spec,expected", [
    ("bf16", torch.bfloat16), ("BF16", torch.bfloat16), (jnp.bfloat16, torch.bfloat16),
    ("source-bf16", torch.bfloat16), ("fp16", torch.float16), ("float32", torch.float32),
])
def test_export_declares_its_dtype_and_transformers_loads_it_so(loaded, tmp_path, spec, expected):
    ref, model, dtypes = loaded
    if spec == "source-bf16":  # per-tensor dtypes, as the trainer exports source dtypes
        spec = {name: np.dtype(ml_dtypes.bfloat16) for name in dtypes}
    out = export_hf(model, tmp_path / "out", dtype=spec)
    cfg = json.loads((out / "config.json").read_text())
    name = str(expected).removeprefix("torch.")
    assert cfg["dtype"] == cfg["torch_dtype"] == name
    assert {SafetensorsFile(out / "model.safetensors").dtype(n).name for n in dtypes} == {name}
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # no dtype: the config decides
    assert {p.dtype for p in reloaded.parameters()} == {expected}
    tokens = np.random.RandomState(2).randint(0, 97, size=(1, 10))
    atol = 1e-5 if expected == torch.float32 else 0.3
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(ref, tokens), atol=atol)


@pytest.mark.parametrize("spec", ["int8", "float64", np.int32, "fp8"])
def test_unsupported_export_dtype_names_dtype_and_the_allowed_values(loaded, tmp_path, spec):
    _, model, dtypes = loaded
    allowed = r"allowed: float32 \(fp32, f32\); bfloat16 \(bf16\); float16 \(fp16, f16, half\)"
    with pytest.raises(ValueError, match=rf"dtype .* cannot be exported; {allowed}"):
        export_hf(model, tmp_path / "a", dtype=spec)
    one_bad = {**{n: "bf16" for n in dtypes}, "model.norm.weight": spec}
    with pytest.raises(ValueError, match=allowed):
        export_hf(model, tmp_path / "b", dtype=one_bad)
    assert list(tmp_path.iterdir()) == []


def test_two_step_publish_writes_the_same_bytes_as_export_hf(loaded, tmp_path, monkeypatch):
    """Same bytes; an export is synced to disk, a published version (transient: a restart
    publishes again) is not."""
    import os

    _, model, dtypes = loaded
    synced, fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"fake": true}')
    (tok / "tokenizer.model").write_bytes(b"sentencepiece")  # the vocabulary of Llama 2's
    # Mixed dtypes: bf16 everywhere except layer 1's q_proj and the final norm.
    mixed = {n: "bf16" for n in dtypes}
    mixed.update({"model.layers.1.self_attn.q_proj.weight": "float32", "model.norm.weight": "fp16"})
    one = export_hf(model, tmp_path / "one", dtype=mixed, tokenizer_dir=tok)
    assert [Path(f).name for f in synced] == ["model.safetensors"]
    assert (one / "tokenizer.model").read_bytes() == b"sentencepiece"
    tensors = hf_state_dict(model, mixed)
    # The snapshot is the model's values at that moment, not a view of its parameters.
    before = {n: t.copy() for n, t in tensors.items()}
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    nnx.update(model, jax.tree.map(lambda x: x + 1, params))
    exports = tmp_path / "exports"
    two = publish_tensors(tensors, model.cfg, exports, 3, keep=1, tokenizer_dir=tok)
    assert two == exports / "v000003" and len(synced) == 1
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for f in one.iterdir():
        assert f.read_bytes() == (two / f.name).read_bytes(), f.name
    for n, t in tensors.items():
        assert t.dtype == before[n].dtype and t.tobytes() == before[n].tobytes(), n
    assert json.loads((two / "config.json").read_text())["dtype"] == "bfloat16"
    # publish_version is the same two steps in one call (and prunes as before).
    nnx.update(model, params)
    three = publish_version(model, exports, 4, keep=1, dtype=mixed, tokenizer_dir=tok)
    assert sorted(p.name for p in exports.iterdir()) == ["v000004"]
    for f in one.iterdir():
        assert f.read_bytes() == (three / f.name).read_bytes(), f.name


def test_exports_keep_the_source_models_generation_config(tmp_path):
    """Llama 3 Instruct lists ``<|eot_id|>`` as an end id in ``generation_config.json`` only:
    exports copy the source model's file unchanged (rebuilt from config.json, it lost that id
    and the engines serving the export never stopped on it)."""
    src = save_hf_model(hf_model("llama", seed=2), tmp_path / "src")  # config.json: eos 2
    gen = json.dumps({"eos_token_id": [2, 90], "temperature": 0.6, "top_p": 0.9}, indent=1)
    (src / "generation_config.json").write_text(gen)
    trainer = Trainer(TrainerConfig(model_path=str(src), run_dir=str(tmp_path / "run")),
                      mesh=one_device_mesh())
    assert (trainer.publish(0) / "generation_config.json").read_text() == gen
    out = export_hf(trainer.model, tmp_path / "out", source_dir=src)
    assert (out / "generation_config.json").read_text() == gen
    # A source without one: the config's token ids, as for a model built in memory.
    (src / "generation_config.json").unlink()
    out = export_hf(trainer.model, tmp_path / "out", source_dir=src)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


def test_bf16_parameters_export_without_a_host_fp32_copy():
    """Each tensor is cast and laid out on its device: the host allocates no fp32 arrays."""
    model = init_model(ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4}))
    graphdef, state = nnx.split(model)
    bf16 = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    hf_state_dict(bf16, "bfloat16")  # compile the conversions first
    tracemalloc.start()
    tensors = hf_state_dict(bf16, "bfloat16")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    total = sum(t.nbytes for t in tensors.values())
    assert peak < total / 4, (peak, total)
    expected = hf_state_dict(model, "bfloat16")  # fp32 params rounded: the same bits
    for n, t in tensors.items():
        assert t.dtype == np.dtype(ml_dtypes.bfloat16)
        assert t.tobytes() == expected[n].tobytes(), n


def test_export_of_tensors_that_do_not_fit_the_config_writes_nothing(loaded, tmp_path):
    _, model, _ = loaded
    tensors = hf_state_dict(model)
    k = "model.layers.0.self_attn.k_proj.weight"  # [32, 32]
    cases = {
        "missing tensor model.norm.weight": {n: t for n, t in tensors.items()
                                             if n != "model.norm.weight"},
        rf"tensor {k} has shape \(16, 64\), the config implies \(32, 32\)":
            {**tensors, k: tensors[k].reshape(16, 64)},
        "does not use: model.layers.0.self_attn.q_proj.bias": {
            **tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)},
    }
    for message, bad in cases.items():
        with pytest.raises(CheckpointError, match=message):
            export_hf_tensors(bad, model.cfg, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
