"""The Flax model against transformers, packed attention and the cached decoding path."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.extend.core import jaxprs_in_params
from transformers import AutoModelForCausalLM

from areal_jax.models import (KVCache, ModelConfig, attention, export_hf, init_model,
                              load_hf_model)
from areal_jax.models.attention import cached_attention, packed_attention
from areal_jax.models.dense import dense

from _hf_models import hf_logits, hf_model, save_hf_model

FAMILIES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True),
            ("llama", False), ("llama", True)]


def _forward(model, tokens):
    seg = np.ones_like(tokens)
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model.forward_logits(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)))


@pytest.mark.parametrize("model_type,tie", FAMILIES)
def test_logits_match_transformers(tmp_path, model_type, tie):
    ref_model = hf_model(model_type, tie=tie, seed=3)
    save_hf_model(ref_model, tmp_path)
    model, _ = load_hf_model(tmp_path)
    # Positions past original_max_position_embeddings exercise llama3 rope scaling.
    tokens = np.random.RandomState(0).randint(0, 97, size=(2, 80))
    ours, ref = _forward(model, tokens), hf_logits(ref_model, tokens)
    assert ref.std() > 0.1
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("x_shape,w_shape,n_in,spec", [
    ((2, 5, 6), (6, 3, 4), 1, "btd,dhk->bthk"),
    ((2, 5, 3, 4), (3, 4, 6), 2, "bthk,hkd->btd"),
    ((2, 5, 6), (6, 7), 1, "btd,dv->btv"),
])
def test_dense_equals_the_einsum_in_value_and_gradients(x_shape, w_shape, n_in, spec):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    out = jnp.einsum(spec, x, w, precision="highest")
    cotangent = jax.random.normal(kg, out.shape)
    ours, pull = jax.vjp(lambda a, b: dense(a, b, n_in=n_in), x, w)
    _, ref_pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, precision="highest"), x, w)
    assert ours.shape == out.shape
    np.testing.assert_allclose(ours, out, rtol=1e-5, atol=1e-5)
    for got, want in zip(pull(cotangent), ref_pull(cotangent)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    exact = jnp.einsum(spec, xb.astype(jnp.float32), wb.astype(jnp.float32), precision="highest")
    wide = dense(xb, wb, n_in=n_in, out_dtype=jnp.float32)
    assert wide.dtype == jnp.float32  # accumulated in fp32, not rounded to bf16
    np.testing.assert_allclose(wide, exact, rtol=1e-5, atol=1e-5)
    narrow = dense(xb, wb, n_in=n_in)
    assert narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(narrow, np.float32),
                                  np.asarray(wide.astype(jnp.bfloat16), np.float32))


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in ``jaxpr`` and the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jaxprs_in_params(eqn.params):
            found += _dot_operand_dtypes(sub)
    return found


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
@pytest.mark.parametrize("n_in", [1, 2])
def test_dense_gradient_products_take_the_operands_dtype(out_dtype, n_in):
    # bf16 operands: the gradient of the fp32 accumulation (or of an fp32 result, as the
    # log-prob head's) is fp32, and without a cast the backward products would be fp32 (TF32
    # on a GPU, at a fraction of the bf16 rate). Both must take bf16 operands and equal the
    # products of the gradient rounded to bf16.
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (2, 5, 3, 4) if n_in == 2 else (2, 5, 12)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (3, 4, 7) if n_in == 2 else (12, 7)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (2, 5, 7))  # fp32, not representable in bf16
    if out_dtype is None:  # the gradient reaching the product is fp32 all the same
        loss = lambda x, w: jnp.sum(dense(x, w, n_in=n_in).astype(jnp.float32) * g)  # noqa: E731
    else:
        loss = lambda x, w: jnp.sum(dense(x, w, n_in=n_in, out_dtype=out_dtype) * g)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    dots = _dot_operand_dtypes(jax.make_jaxpr(grad)(x, w).jaxpr)
    assert len(dots) == 3 and all(d == ("bfloat16", "bfloat16") for d in dots), dots
    dx, dw = grad(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
    as64 = lambda a: np.asarray(a, np.float64).reshape(10, -1)  # noqa: E731
    rounded, exact = as64(g.astype(jnp.bfloat16)), as64(g)
    xf, wf = as64(x), np.asarray(w, np.float64).reshape(12, 7)

    def bf16(a):  # the fp32 accumulation's result rounded to bf16
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)

    np.testing.assert_array_equal(as64(dx), bf16(rounded @ wf.T))
    np.testing.assert_array_equal(np.asarray(dw, np.float64).reshape(12, 7), bf16(xf.T @ rounded))
    assert not np.array_equal(as64(dx), bf16(exact @ wf.T))  # the rounding is visible


def test_remat_dots_keeps_the_projections_and_full_recomputes_them():
    # The projections' products sit inside ``dense``'s custom gradient, out of sight of a
    # policy that saves matrix products; ``remat: dots`` saves them by name instead, so its
    # backward recomputes none of them, where ``full`` recomputes every one.
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    tokens, positions = jnp.ones((1, 16), jnp.int32), jnp.arange(16)[None]
    counts = {}
    for remat in ("none", "dots", "full"):
        model = init_model(cfg, dtype=jnp.bfloat16, remat=remat, scan_layers=False)
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            hidden, _ = nnx.merge(graphdef, p)(tokens, jnp.ones_like(tokens), positions)
            return hidden.astype(jnp.float32).sum()

        lowered = jax.jit(jax.grad(loss)).lower(params).as_text()  # remat expanded
        counts[remat] = lowered.count("stablehlo.dot_general")
    projections = 7 * cfg.num_layers  # q, k, v, o, gate, up, down
    assert counts["full"] - counts["none"] >= projections, counts
    assert counts["dots"] - counts["none"] < projections, counts


def test_packed_row_equals_each_sequence_alone(tmp_path):
    ref_model = hf_model("qwen3", seed=5)
    model, _ = load_hf_model(save_hf_model(ref_model, tmp_path))
    rng = np.random.RandomState(1)
    seqs = [rng.randint(0, 97, size=n) for n in (7, 12, 5)]
    tokens = np.concatenate(seqs + [np.zeros(8, int)])[None]
    segs = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(seqs)] + [np.zeros(8, int)])[None]
    pos = np.concatenate([np.arange(len(s)) for s in seqs] + [np.arange(8)])[None]
    packed = np.asarray(model.forward_logits(jnp.asarray(tokens), jnp.asarray(segs), jnp.asarray(pos)))[0]
    assert np.isfinite(packed).all()
    start = 0
    for s in seqs:
        alone = _forward(model, s[None])[0]
        np.testing.assert_allclose(packed[start:start + len(s)], alone, atol=1e-5, rtol=0)
        start += len(s)


def test_cached_decoding_matches_full_forward(tmp_path):
    """Prefill a prompt into a cache slot, then feed tokens one at a time: same logits."""
    ref_model = hf_model("qwen2", seed=7)
    model, _ = load_hf_model(save_hf_model(ref_model, tmp_path))
    rng = np.random.RandomState(2)
    seq = rng.randint(0, 97, size=(2, 14))
    full = _forward(model, seq)
    cache = KVCache.zeros(model.cfg, batch=2, length=32)
    # Row 0 prefills 9 tokens, row 1 prefills 6 tokens padded to 9 (padding must not write).
    plen = np.array([9, 6])
    tok = seq[:, :9].copy()
    seg = (np.arange(9)[None] < plen[:, None]).astype(np.int32)
    pos = np.broadcast_to(np.arange(9), (2, 9)).copy()
    tok[1, 6:] = 0
    hidden, cache = model(jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos), cache)
    logits = np.asarray(model.logits(hidden))
    np.testing.assert_allclose(logits[0, :9], full[0, :9], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, :6], full[1, :6], atol=1e-5, rtol=0)
    cur = plen.copy()
    for _ in range(4):
        step_tok = seq[np.arange(2), cur][:, None]
        hidden, cache = model(jnp.asarray(step_tok), jnp.ones((2, 1), jnp.int32),
                              jnp.asarray(cur[:, None]), cache)
        step = np.asarray(model.logits(hidden))[:, 0]
        np.testing.assert_allclose(step, full[np.arange(2), cur], atol=1e-5, rtol=0)
        cur += 1


def _reference_attention(q, k, v, mask, xp=np):
    """Dense GQA softmax attention in NumPy (or ``xp=jnp``, differentiable): q [B, T, Hq, D],
    k/v [B, S, Hkv, D], mask [B, T, S]."""
    group = q.shape[2] // k.shape[2]
    k, v = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    scores = xp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = xp.where(mask[:, None], scores, -1e30)
    probs = xp.exp(scores - scores.max(-1, keepdims=True))
    return xp.einsum("bhts,bshd->bthd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("chunk_bytes", [0, 4 << 20])
def test_block_packed_attention_and_its_gradients_equal_dense_reference(monkeypatch, chunk_bytes):
    """Rows of 40 (not a multiple of the block), segments crossing block boundaries; block 3
    gives 14 blocks in 8 key-length groups (several blocks per loop), 64 one block of 40.
    Gradients of the custom backward match autodiff of the dense reference; padding rows give
    zeros and receive no gradient. Without a gradient the 4 rows go through all at once
    (``chunk_bytes`` 0) or in a loop over chunks of 2 (as on a lone CPU device; the suite runs
    8 virtual devices, where rows are never chunked)."""
    assert not attention._one_cpu()
    monkeypatch.setattr(attention, "_one_cpu", lambda: True)
    monkeypatch.setattr(attention, "_CHUNK_BYTES", chunk_bytes)
    assert attention._rows_per_chunk(4, 1) == (4 if chunk_bytes == 0 else 2)
    rng = np.random.RandomState(3)
    q = rng.normal(size=(4, 40, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(4, 40, 2, 8)).astype(np.float32) for _ in range(2))
    seg = np.zeros((4, 40), np.int32)
    seg[0, :13], seg[0, 13:30], seg[0, 30:37] = 1, 2, 3  # 37..39 padding
    seg[1, :40] = 1
    seg[2, :25] = 1
    seg[3, :5], seg[3, 5:10], seg[3, 10:40] = 1, 2, 3
    idx = np.arange(40)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, :, None] & (idx[:, None] >= idx)
    expected = _reference_attention(q, k, v, mask)
    weight = rng.normal(size=q.shape).astype(np.float32) * (seg != 0)[:, :, None, None]

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weight)

    dense = jax.grad(loss(lambda q, k, v: _reference_attention(q, k, v, mask, xp=jnp)),
                     argnums=(0, 1, 2))(q, k, v)
    for block in (3, 8, 64):
        attend = lambda q, k, v: packed_attention(q, k, v, jnp.asarray(seg), block=block)
        got = np.asarray(attend(*map(jnp.asarray, (q, k, v))))
        np.testing.assert_allclose(got[seg != 0], expected[seg != 0], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(got[seg == 0], 0.0)
        grads = jax.grad(loss(attend), argnums=(0, 1, 2))(q, k, v)
        for name, g, ref in zip("qkv", grads, dense):
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=2e-5, rtol=0,
                                       err_msg=f"d{name}, block {block}")
        assert not np.asarray(grads[0])[seg == 0].any()


def test_cached_attention_ignores_stale_entries_from_first_write_on():
    """Row 0 decodes at position 5 over 5 valid entries; row 1 re-prefills positions 0..2 over
    a cache full of stale entries, which must all be ignored."""
    rng = np.random.RandomState(4)
    q = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 3, 2, 8)).astype(np.float32) for _ in range(2))
    ck, cv = (rng.normal(size=(2, 2, 16, 8)).astype(np.float32) for _ in range(2))
    seg = np.array([[1, 0, 0], [1, 1, 1]], np.int32)
    pos = np.array([[5, 6, 7], [0, 1, 2]], np.int32)
    got = np.asarray(cached_attention(*map(jnp.asarray, (q, k, v, ck, cv, seg, pos))))
    old_k, old_v = np.swapaxes(ck, 1, 2), np.swapaxes(cv, 1, 2)
    row0 = _reference_attention(q[:1, :1], np.concatenate([old_k[:1, :5], k[:1, :1]], 1),
                                np.concatenate([old_v[:1, :5], v[:1, :1]], 1),
                                np.ones((1, 1, 6), bool))
    np.testing.assert_allclose(got[0, 0], row0[0, 0], atol=1e-5, rtol=0)
    row1 = _reference_attention(q[1:], k[1:], v[1:], np.tril(np.ones((3, 3), bool))[None])
    np.testing.assert_allclose(got[1], row1[0], atol=1e-5, rtol=0)


def test_unrolled_layers_equal_scanned_layers(tmp_path):
    path = save_hf_model(hf_model("llama", seed=6), tmp_path)
    scanned, _ = load_hf_model(path)
    unrolled, _ = load_hf_model(path, scan_layers=False)
    tokens = np.random.RandomState(5).randint(0, 97, size=(2, 24))
    np.testing.assert_allclose(_forward(unrolled, tokens), _forward(scanned, tokens),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_bias_matches_transformers_and_round_trips(tmp_path, model_type):
    """``attention_bias: true`` adds q/k/v *and* o_proj biases (all randomised here)."""
    ref_model = hf_model(model_type, seed=12, attention_bias=True)
    assert ref_model.model.layers[1].self_attn.o_proj.bias.abs().sum() > 1
    model, dtypes = load_hf_model(save_hf_model(ref_model, tmp_path / "src"))
    assert "model.layers.1.self_attn.o_proj.bias" in dtypes
    tokens = np.random.RandomState(6).randint(0, 97, size=(2, 24))
    np.testing.assert_allclose(_forward(model, tokens), hf_logits(ref_model, tokens),
                               atol=1e-4, rtol=0)
    export_hf(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(reloaded.eval(), tokens), hf_logits(ref_model, tokens),
                               atol=1e-5, rtol=0)


ROPE_SCALING = {
    # As model cards tell users to add it (Qwen3: YaRN); "type" is the older key name.
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn-mscale": ("llama", {"type": "yarn", "factor": 3.0, "original_max_position_embeddings": 24,
                              "beta_fast": 16, "mscale": 1.2, "mscale_all_dim": 0.8,
                              "rope_theta": 5000.0}),
    "llama3": ("qwen2", {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear": ("llama", {"rope_type": "linear", "factor": 2.5}),
    # A top-level original_max_position_embeddings wins over the one inside (Phi-3 keeps it
    # there; read only inside, logits differed by up to 5.7); without either, the model's own.
    "llama3-top-level-length": ("qwen2", {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16},
                                {"original_max_position_embeddings": 40}),
    "yarn-top-level-length": ("llama", {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 16},
                              {"original_max_position_embeddings": 32}),
    "yarn-no-length": ("qwen3", {"rope_type": "yarn", "factor": 2.0}),
}


@pytest.mark.parametrize("case", sorted(ROPE_SCALING))
def test_top_level_rope_scaling_is_honoured_like_transformers(tmp_path, case):
    """A ``rope_scaling`` added beside the saved ``rope_parameters`` takes its place whole
    (its own ``rope_theta``, else the default: the saved theta is dropped, as transformers does)."""
    model_type, scaling, *top = ROPE_SCALING[case]
    path = save_hf_model(hf_model(model_type, seed=13), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] in ("default", "llama3")
    (path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling, **(top or [{}])[0]}))
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, _ = load_hf_model(path)
    assert model.cfg.rope_scaling.rope_type == case.split("-")[0]
    tokens = np.random.RandomState(8).randint(0, 97, size=(1, 90))
    np.testing.assert_allclose(_forward(model, tokens), hf_logits(ref_model, tokens),
                               atol=1e-4, rtol=0)
