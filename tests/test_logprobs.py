"""Chunked per-token log-probs and entropies against the unchunked computation."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.rl.logprobs import token_logprobs

R, T, D, V = 3, 10, 8, 64


def _inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(R, T, D)), dtype)
    kernel = jnp.asarray(rng.normal(size=(D, V)) * 0.7, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (R, T)), jnp.int32)
    return hidden, kernel, targets


def _numpy_reference(hidden, kernel, targets, temperature):
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64) / temperature
    logits -= logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    return logp, entropy


def _unchunked(hidden, kernel, targets, temperature):
    logp_all = jax.nn.log_softmax(hidden.astype(jnp.float32) @ kernel / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 10, 64])
def test_matches_reference(chunk_size):
    hidden, kernel, targets = _inputs()
    logp, entropy = token_logprobs(hidden, kernel, targets, 0.7, chunk_size)
    assert logp.dtype == entropy.dtype == jnp.float32 and logp.shape == (R, T)
    ref_logp, ref_entropy = _numpy_reference(hidden, kernel, targets, 0.7)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5)


def test_gradients_match_unchunked():
    hidden, kernel, targets = _inputs(1)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(2, R, T)), jnp.float32)

    def objective(fn):
        def f(h, k):
            logp, entropy = fn(h, k)
            return (weights[0] * logp).sum() + (weights[1] * entropy).sum()

        return jax.grad(f, argnums=(0, 1))(hidden, kernel)

    chunked = objective(lambda h, k: token_logprobs(h, k, targets, 1.3, 4))
    plain = objective(lambda h, k: _unchunked(h, k, targets, 1.3))
    for a, b in zip(chunked, plain, strict=True):
        assert float(jnp.abs(b).max()) > 0.1
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_full_logits_never_materialised():
    hidden, kernel, targets = _inputs()

    def f(h, k):
        logp, entropy = token_logprobs(h, k, targets, 1.0, 4)
        return logp.sum() + entropy.sum()

    sizes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, kernel).jaxpr)
    # The largest intermediate is one chunk of logits, [R, 4, V], forward and backward.
    assert max(sizes) == R * 4 * V


def test_bf16_hidden_upcasts():
    hidden, kernel, targets = _inputs(3, jnp.bfloat16)
    logp, entropy = token_logprobs(hidden, kernel, targets, 1.0, 4)
    assert logp.dtype == jnp.float32
    ref_logp, ref_entropy = _numpy_reference(hidden.astype(jnp.float32), kernel, targets, 1.0)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5)


def test_bad_input():
    hidden, kernel, targets = _inputs()
    with pytest.raises(ValueError, match=r"head_kernel must be \[D=8, V\]"):
        token_logprobs(hidden, kernel.T, targets)
    with pytest.raises(ValueError, match=r"targets must be \[R, T\]"):
        token_logprobs(hidden, kernel, targets[:, :5])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(hidden, kernel, targets, 0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        token_logprobs(hidden, kernel, targets, 1.0, 0)
