"""Loaded weights must be exactly what the model expects, or the load fails and changes nothing."""

import asyncio
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from _hf_models import edit_weights, hf_greedy, hf_logits, hf_model, save_hf_model
from areal_jax.models import CheckpointError, load_hf_model
from areal_jax.models.safetensors_io import SafetensorsFile
from rollout.config import EngineConfig
from rollout.engine import SamplingParams, WeightLoadError
from rollout.engines import create_engine

Q0 = "model.layers.0.self_attn.q_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_hf_model(hf_model("qwen2", seed=8), tmp_path_factory.mktemp("src"))


def _variant(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    edit_weights(dst, edit)
    return dst


def _set(name, fn):
    def edit(tensors):
        tensors[name] = fn(tensors[name])
    return edit


def _poison(value, index=(1, 3)):
    def fn(t):
        t = t.copy()
        t[index] = value
        return t
    return fn


BAD = {
    # Same element count, another shape: used to be silently reshaped.
    "shape": (_set(K0, lambda t: t.reshape(t.shape[1], t.shape[0])),
              rf"tensor {K0} has shape \(32, 16\), the config implies \(16, 32\)"),
    "bias-shape": (_set("model.layers.1.self_attn.k_proj.bias", lambda t: t.reshape(2, -1)),
                   r"tensor model.layers.1.self_attn.k_proj.bias has shape \(2, 8\), "
                   r"the config implies \(16,\)"),
    # An int32 header over float bytes: used to be cast to float.
    "int-dtype": (_set(Q0, lambda t: t.view(np.int32)),
                  rf"tensor {Q0} has dtype int32; supported: float32, bfloat16, float16"),
    "nan": (_set("model.layers.1.mlp.down_proj.weight", _poison(np.nan)),
            r"tensor model.layers.1.mlp.down_proj.weight has 1 non-finite values"),
    "inf-bf16": (_set("model.norm.weight",
                      lambda t: _poison(np.inf, (5,))(t.astype(ml_dtypes.bfloat16))),
                 r"tensor model.norm.weight has 1 non-finite values"),
    "unused": (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.ones(32, np.float32),
                                   "model.layers.9.mlp.up_proj.weight": np.ones(2, np.float32)}),
               r"has tensors the qwen2 config does not use: model.layers.0.self_attn.o_proj.bias, "
               r"model.layers.9.mlp.up_proj.weight"),
    # A layer index of 5000 digits was a ValueError from int() (Python's digit limit).
    "huge-layer-index": (lambda t: t.update({f"model.layers.{'9' * 5000}.x": np.ones(2, np.float32)}),
                         r"has tensors the qwen2 config does not use: model.layers.9999"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_weights_are_refused_naming_the_tensor(src, tmp_path, case):
    edit, message = BAD[case]
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(_variant(src, tmp_path / case, edit))


def test_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    path = save_hf_model(hf_model("qwen2", tie=True, seed=8), tmp_path / "tied")
    edit_weights(path, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + np.float32(0.5)}))
    with pytest.raises(CheckpointError, match="tensor lm_head.weight differs from "
                       "model.embed_tokens.weight, but tie_word_embeddings is true"):
        load_hf_model(path)


def test_harmless_extras_are_tolerated(tmp_path):
    """Rotary buffers and a tied head written out equal to the embedding load as without them."""
    ref = hf_model("qwen3", tie=True, seed=9)
    path = save_hf_model(ref, tmp_path / "m")
    edit_weights(path, lambda t: t.update({
        "lm_head.weight": t["model.embed_tokens.weight"].copy(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    model, dtypes = load_hf_model(path)
    assert "lm_head.weight" not in dtypes
    tokens = np.random.RandomState(1).randint(0, 97, size=(1, 16))
    ours = np.asarray(model.forward_logits(tokens, np.ones_like(tokens), np.arange(16)[None]))
    np.testing.assert_allclose(ours, hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_index_naming_a_tensor_its_file_lacks_is_refused(src, tmp_path):
    path = _variant(src, tmp_path / "idx", lambda t: None)
    index = {"weight_map": {Q0: "model.safetensors", "extra.weight": "model.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the index lists tensor extra.weight in "
                                              "model.safetensors, which lacks it"):
        load_hf_model(path)


def test_an_index_hiding_tensors_of_its_files_is_refused(src, tmp_path):
    # With an index, only the tensors it lists were checked: unused ones left out of it loaded.
    path = _variant(src, tmp_path / "hidden", BAD["unused"][0])
    names = [n for n in SafetensorsFile(path / "model.safetensors").keys()
             if "o_proj.bias" not in n and "layers.9." not in n]
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model.safetensors" for n in names}}))
    with pytest.raises(CheckpointError, match="model.safetensors holds tensors the index does "
                       "not list there: model.layers.0.self_attn.o_proj.bias, "
                       "model.layers.9.mlp.up_proj.weight"):
        load_hf_model(path)
    for bad in (b"\xff\xfe", b"[" * 100_000):  # not UTF-8; nested too deep
        (path / "model.safetensors.index.json").write_bytes(bad)
        with pytest.raises(CheckpointError, match="cannot read weights in"):
            load_hf_model(path)


def _with_header(path, edit, data_edit=lambda data: data):
    """Rewrite ``path``'s model.safetensors with ``edit(header dict)`` applied (or, when it
    returns bytes, those as the raw header) and ``data_edit`` applied to the bytes after it."""
    f = path / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    new = edit(header)
    blob = new if isinstance(new, bytes) else json.dumps(header).encode()
    f.write_bytes(len(blob).to_bytes(8, "little") + blob + data_edit(raw[8 + n:]))
    return path


def _entry(key, value):
    def edit(header):
        header["model.norm.weight"][key] = value
    return edit


def _alias(header):  # the norm's bytes made to be another tensor's
    other = next(k for k, e in header.items() if k != "model.norm.weight"
                 and k != "__metadata__" and e["shape"] == header["model.norm.weight"]["shape"])
    header["model.norm.weight"]["data_offsets"] = header[other]["data_offsets"]


FORGED = {
    # Negative offsets read the header's own bytes as weights (or wrap to the file's end).
    "negative-offsets": (_entry("data_offsets", [-128, 0]), "data_offsets that are not two "
                         "integers in \\[0, 2\\*\\*63\\): \\[-128, 0\\]"),
    "float-offsets": (_entry("data_offsets", [0.0, 128.0]), "data_offsets that are not two"),
    "entry-not-object": (lambda h: h.update({"model.norm.weight": "x"}),
                         "tensor model.norm.weight has a header entry that is not a JSON object"),
    "shape-not-list": (_entry("shape", "32"), "has a shape that is not a list"),
    "aliased-bytes": (_alias, "starts at byte .* before it ends at"),
    "nested-header": (lambda h: b"[" * 100_000, "has a corrupt header"),
    "header-not-object": (lambda h: b"[1, 2]", "the header is not a JSON object"),
    "huge-header": (None, "has a header of 1099511627776 bytes, more than"),
    "trailing-bytes": (lambda h: None, "has 7 bytes after its last tensor"),
    # Byte counts from shapes in int64 overflowed (a raw OverflowError) or wrapped to 0.
    "shape-beyond-int64": (_entry("shape", [2**64]), "has a shape that is not a list of "
                           "integers in \\[0, 2\\*\\*63\\): \\[18446744073709551616\\]"),
    "shape-wrapping-to-0": (_entry("shape", [2**32, 2**32]), "has a byte range of 128 bytes, "
                            "its dtype and shape need 73786976294838206464"),
    # A product of huge integers cost time quadratic in the header's size (15 s for 2 MB, hours
    # at the header size limit), then failed naming neither the tensor nor the problem.
    "huge-integers": (_entry("shape", [int("9" * 4000)] * 300), "has a shape that is not a "
                      "list of integers in"),
    "too-many-dimensions": (_entry("shape", [1] * 64 + [32]), "has 65 dimensions, more than 64"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_safetensors_headers_are_refused(src, tmp_path, case):
    edit, message = FORGED[case]
    path = _variant(src, tmp_path / case, lambda t: None)
    if case == "huge-header":
        f = path / "model.safetensors"
        f.write_bytes((1 << 40).to_bytes(8, "little") + f.read_bytes()[8:])
    else:
        _with_header(path, edit, (lambda d: d + b"\0" * 7) if case == "trailing-bytes" else
                     (lambda d: d))
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(path)


def test_a_header_of_many_tensors_is_checked_in_one_pass_per_file(src, tmp_path, monkeypatch):
    # Each tensor's presence was checked against a fresh list of the file's names: 40,000
    # zero-size tensors took 48 s, a header at the size limit hours, the server's weight
    # updates blocked meanwhile.
    path = _variant(src, tmp_path / "many", lambda t: None)
    end = max(e["data_offsets"][1] for k, e in json.loads(
        (path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
            (path / "model.safetensors").read_bytes()[:8], "little")]).items()
        if k != "__metadata__")
    _with_header(path, lambda h: h.update({f"extra.{i}": {"dtype": "F32", "shape": [0],
                                                          "data_offsets": [end, end]}
                                           for i in range(2000)}))
    listed = []
    keys = SafetensorsFile.keys
    monkeypatch.setattr(SafetensorsFile, "keys", lambda self: listed.append(1) or keys(self))
    with pytest.raises(CheckpointError, match="extra.0"):  # not the model's: refused
        load_hf_model(path)
    assert len(listed) <= 2  # the names listed once or twice, not once per tensor


def test_config_files_over_the_size_limit_are_not_parsed(src, tmp_path):
    # A pushed config.json of 37 MB (nested empty lists) took 1.1 GB to parse.
    from areal_jax.models import ModelConfig, ModelConfigError
    from areal_jax.models.config import MAX_CONFIG_BYTES

    path = _variant(src, tmp_path / "big-config", lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "pad": [[]] * (MAX_CONFIG_BYTES // 4)}))
    with pytest.raises(ModelConfigError, match=r"config.json is over 4 MiB, more than such a "
                                               r"file ever holds: not read"):
        ModelConfig.from_pretrained(path)


def test_values_beyond_the_serving_dtype_are_refused(src, tmp_path):
    # Finite fp32, yet inf once cast to bf16: the check on the file's values passed them.
    path = _variant(src, tmp_path / "big", _set("model.norm.weight", _poison(3.4e38, (5,))))
    load_hf_model(path)  # fine in fp32
    with pytest.raises(CheckpointError, match="tensor model.norm.weight has values beyond the "
                                              "range of bfloat16"):
        load_hf_model(path, param_dtype=jnp.bfloat16)


def test_index_mapping_a_tensor_outside_the_checkpoint_is_refused(src, tmp_path):
    # Pushed files are checked by name, but the index could point anywhere on the host.
    path = _variant(src, tmp_path / "idx", lambda t: None)
    for target in (str(src / "model.safetensors"), "../src/model.safetensors"):
        index = {"weight_map": {Q0: "model.safetensors", K0: target}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=f"tensor {K0} is mapped to .*, not a file name"):
            load_hf_model(path)


def test_an_index_mapping_a_tensor_to_a_fifo_or_a_directory_is_refused_at_once(src, tmp_path):
    # A FIFO's open waited for a writer for ever: the load never ended, and a server, whose
    # loads run one at a time, took no update again.
    import concurrent.futures
    import os

    path = _variant(src, tmp_path / "idx", lambda t: None)
    os.mkfifo(path / "fifo.safetensors")
    (path / "dir.safetensors").mkdir()
    for target in ("fifo.safetensors", "dir.safetensors"):
        index = {"weight_map": {Q0: "model.safetensors", K0: target}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(load_hf_model, path)
            try:
                with pytest.raises(CheckpointError, match=f"{target} is not a regular file"):
                    load.result(timeout=30)
            finally:
                if not load.done():  # held in the FIFO's open: a writer lets it go on
                    with open(path / "fifo.safetensors", "wb"):
                        pass


def test_weights_files_whose_headers_add_up_past_the_bound_are_not_parsed(src, tmp_path):
    # Each header within the per-file bound, but every file listed was parsed before any
    # check: 300 MiB of headers took 2.7 GB of memory and 48 s.
    import struct

    path = _variant(src, tmp_path / "idx", lambda t: None)
    claim = 40 << 20  # each shard's header claims 40 MiB: 120 MiB in all
    for i in range(3):
        (path / f"shard{i}.safetensors").write_bytes(struct.pack("<Q", claim) + b"{}")
    index = {"weight_map": {Q0: "shard0.safetensors", K0: "shard1.safetensors",
                            "x": "shard2.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"the 3 weights files of .* have headers of "
                                              r"125829120 bytes in all, more than 104857600"):
        load_hf_model(path)


def test_engine_refuses_bad_weights_and_keeps_serving_the_old_ones(src, tmp_path):
    ref = hf_model("qwen2", seed=8)
    bad = {c: _variant(src, tmp_path / c, BAD[c][0]) for c in ("nan", "unused", "shape")}
    bad["float-offsets"] = _with_header(_variant(src, tmp_path / "forged", lambda t: None),
                                        FORGED["float-offsets"][0])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompt = [5, 17, 3, 88, 41]

    async def main():
        engine = create_engine(EngineConfig(kind="jax", model_path=str(src), options=dict(
            num_slots=2, max_seq_len=32, decode_steps_per_call=4)))
        await engine.start()
        errors = {}
        for case, path in bad.items():
            with pytest.raises(WeightLoadError) as e:
                await engine.update_weights(str(path), 7)
            errors[case] = str(e.value)
        out = await engine.generate_full(prompt, greedy, "after")
        await engine.shutdown()
        return errors, out

    errors, out = asyncio.run(main())
    assert "model.layers.1.mlp.down_proj.weight has 1 non-finite values" in errors["nan"]
    assert "model.layers.9.mlp.up_proj.weight" in errors["unused"]
    assert K0 in errors["shape"]
    assert "model.norm.weight has data_offsets that are not two" in errors["float-offsets"]
    assert set(out.versions) == {0}
    assert out.output_ids == hf_greedy(ref, prompt, 12)


def _rounded(tensors, casts):
    for name, dtype in casts.items():
        tensors[name] = tensors[name].astype(dtype)


@pytest.mark.parametrize("mesh_shape", [None, (1, 2, 4)])
def test_mixed_dtypes_load_exactly_in_any_parameter_dtype(src, tmp_path, mesh_shape):
    """Tensors stored as bf16 and fp16 among fp32 ones load to exactly their values (no
    rounding through another dtype), in fp32 or straight into bf16 parameters, on one device
    and on a mesh where each device reads only its shard."""
    from areal_jax.parallel import MeshConfig, make_mesh
    from flax import nnx

    down1 = "model.layers.1.mlp.down_proj.weight"
    casts = {Q0: ml_dtypes.bfloat16, down1: np.float16, "model.embed_tokens.weight":
             ml_dtypes.bfloat16}
    mixed = _variant(src, tmp_path / "mixed", lambda t: _rounded(t, casts))
    # The same values, every tensor stored as fp32.
    wide = _variant(mixed, tmp_path / "wide", lambda t: _rounded(
        t, {n: np.float32 for n in casts}))
    mesh = None if mesh_shape is None else make_mesh(MeshConfig(*mesh_shape))
    for param_dtype in (np.float32, ml_dtypes.bfloat16):
        got, dtypes = load_hf_model(mixed, mesh, param_dtype=param_dtype)
        want, _ = load_hf_model(wide, mesh)
        assert dtypes[Q0] == ml_dtypes.bfloat16 and dtypes[down1] == np.float16
        for (path, a), (_, b) in zip(nnx.state(got).flat_state(), nnx.state(want).flat_state()):
            a = np.asarray(a.get_value())
            assert a.dtype == param_dtype, path
            np.testing.assert_array_equal(a, np.asarray(b.get_value()).astype(param_dtype))


def test_non_finite_counts_per_dtype():
    from areal_jax.models.hf_io import count_non_finite

    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        a = np.arange(24, dtype=np.float32).reshape(4, 6).astype(dtype)
        assert count_non_finite(a) == 0
        a[0, 1], a[2, 3], a[3, 5] = np.nan, np.inf, -np.inf
        assert count_non_finite(a) == 3, dtype
        assert count_non_finite(np.full(5, ml_dtypes.finfo(dtype).max, dtype)) == 0
