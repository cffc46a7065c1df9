"""Decoupled PPO loss and gradient against a NumPy reference; aggregation and accumulation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.config import ConfigError, from_dict
from areal_jax.rl.losses import (
    LossConfig,
    accumulate_stats,
    loglinear_proximal_logprobs,
    loss_normalizer,
    policy_loss,
    summarize_stats,
)

R, T = 4, 32


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lb = -rng.random((R, T)) * 3.0
    lp = lb + rng.normal(0.0, 0.8, (R, T))  # behaviour weights from ~0.1 to ~10
    lc = lp + rng.normal(0.0, 0.5, (R, T))  # ratios well outside [0.7, 1.3] on both sides
    adv = rng.normal(0.0, 1.0, (R, T))
    mask = (rng.random((R, T)) < 0.75).astype(np.float32)
    return [x.astype(np.float32) for x in (lc, lp, lb, adv)] + [mask]


def _reference(cfg, lc, lp, lb, adv, mask):
    """Per-token loss and d(loss_t)/d(lc_t) [R, T], written out branch by branch in float64."""
    lc, lp, lb, adv = (np.asarray(x, np.float64) for x in (lc, lp, lb, adv))
    decoupled = cfg.policy_loss == "decoupled_ppo"
    if not decoupled:
        lp = lb
    u = np.exp(lc - lp)
    plain, clipped = -adv * u, -adv * np.clip(u, 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high)
    use_clipped = clipped > plain
    loss = np.where(use_clipped, clipped, plain)
    grad = np.where(use_clipped, 0.0, -adv * u)  # clip(u) is flat where it binds
    if cfg.dual_clip is not None:
        dual = (adv < 0) & (loss > cfg.dual_clip * -adv)
        loss = np.where(dual, cfg.dual_clip * -adv, loss)
        grad = np.where(dual, 0.0, grad)
    if decoupled:
        w = np.exp(lp - lb)
        if cfg.behav_weight_cap is not None and cfg.behav_cap_mode == "mask":
            w = np.where(w > cfg.behav_weight_cap, 0.0, w)
        elif cfg.behav_weight_cap is not None:
            w = np.minimum(w, cfg.behav_weight_cap)
        loss, grad = loss * w, grad * w
    return np.where(mask > 0, loss, 0.0), np.where(mask > 0, grad, 0.0)


CASES = {
    "no_cap": LossConfig(behav_weight_cap=None),
    "cap_mask": LossConfig(behav_weight_cap=2.0, behav_cap_mode="mask"),
    "cap_truncate": LossConfig(behav_weight_cap=2.0, behav_cap_mode="truncate"),
    "asymmetric": LossConfig(eps_clip_low=0.1, eps_clip_high=0.28, behav_weight_cap=3.0),
    "dual_clip": LossConfig(dual_clip=1.5, behav_weight_cap=2.0),
    "ppo": LossConfig(policy_loss="ppo", eps_clip_low=0.15, eps_clip_high=0.25, dual_clip=2.0),
}


@pytest.mark.parametrize("name", CASES)
def test_loss_and_grad_match_numpy(name):
    cfg = CASES[name]
    lc, lp, lb, adv, mask = _inputs()
    norm = 57.0
    (loss, stats), grad = jax.value_and_grad(
        lambda x: policy_loss(cfg, x, lp, lb, adv, mask, norm), has_aux=True
    )(jnp.asarray(lc))
    ref_loss, ref_grad = _reference(cfg, lc, lp, lb, adv, mask)
    np.testing.assert_allclose(float(loss), ref_loss.sum() / norm, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad / norm, rtol=1e-5, atol=1e-7)

    # The inputs exercise every branch the case turns on.
    m = mask > 0
    ref_lp = lp if cfg.needs_proximal else lb
    u = np.exp(lc.astype(np.float64) - ref_lp)
    hi, lo = (u > 1 + cfg.eps_clip_high) & (adv > 0) & m, (u < 1 - cfg.eps_clip_low) & (adv < 0) & m
    assert hi.sum() > 3 and lo.sum() > 3
    assert stats["clip_frac"] == hi.sum() + lo.sum()
    assert stats["n_tokens"] == m.sum()
    w = np.exp(lp.astype(np.float64) - lb) if cfg.needs_proximal else np.ones((R, T))
    if cfg.needs_proximal and cfg.behav_weight_cap is not None:
        assert stats["capped_frac"] == ((w > cfg.behav_weight_cap) & m).sum() > 3
    else:
        assert stats["capped_frac"] == 0
    if cfg.dual_clip is not None:
        dual = (adv < 0) & (u > cfg.dual_clip) & m
        assert stats["dual_clip_frac"] == dual.sum() > 0
    np.testing.assert_allclose(stats["behav_weight"], (w * m).sum(), rtol=1e-5)
    np.testing.assert_allclose(stats["behav_weight_max"], w[m].max(), rtol=1e-5)
    np.testing.assert_allclose(stats["approx_kl"], ((u - 1 - np.log(u)) * m).sum(), rtol=1e-4)
    np.testing.assert_allclose(stats["pg_loss"], ref_loss.sum(), rtol=1e-5)


@pytest.mark.parametrize("cap, mode", [(None, "mask"), (1.0, "mask"), (1.0, "truncate")])
def test_standard_ppo_recovered_when_proximal_equals_behaviour(cap, mode):
    lc, _, lb, adv, mask = _inputs(1)
    dec = LossConfig(behav_weight_cap=cap, behav_cap_mode=mode, eps_clip_high=0.3)
    ppo = dataclasses.replace(dec, policy_loss="ppo")

    def value_and_grad(cfg, prox):
        return jax.value_and_grad(lambda x: policy_loss(cfg, x, prox, lb, adv, mask, 10.0)[0])(lc)

    loss_dec, grad_dec = value_and_grad(dec, lb)
    loss_ppo, grad_ppo = value_and_grad(ppo, lc * 7.0)  # ppo ignores prox_logp
    np.testing.assert_allclose(loss_dec, loss_ppo, rtol=1e-6)
    np.testing.assert_allclose(grad_dec, grad_ppo, rtol=1e-6)
    assert float(jnp.abs(grad_ppo).max()) > 0.01


def test_first_update_on_stale_data_decoupled_adds_what_standard_ppo_clips():
    """At the first update of a batch the policy is the proximal one (lc = lp): the decoupled
    gradient is -A w on every token (nothing clips), standard PPO's the same where its ratio to
    the behaviour policy (= w) is inside the trust region and 0 where it clips."""
    _, lp, lb, adv, mask = _inputs(2)
    dec = LossConfig(behav_weight_cap=None)
    ppo = dataclasses.replace(dec, policy_loss="ppo")
    grad_dec, grad_ppo = (
        np.asarray(jax.grad(lambda x, c=cfg: policy_loss(c, x, lp, lb, adv, mask, 1.0)[0])(lp))
        for cfg in (dec, ppo))
    w = np.exp(lp.astype(np.float64) - lb)
    m = mask > 0
    np.testing.assert_allclose(grad_dec, np.where(m, -adv * w, 0.0), rtol=1e-5, atol=1e-7)
    clipped = m & (((w > 1 + ppo.eps_clip_high) & (adv > 0))
                   | ((w < 1 - ppo.eps_clip_low) & (adv < 0)))
    assert clipped.sum() > 10 and (m & ~clipped).sum() > 10
    np.testing.assert_allclose(grad_ppo, np.where(clipped, 0.0, grad_dec), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum"])
def test_micro_batches_sum_to_minibatch_loss(aggregation):
    cfg = LossConfig(aggregation=aggregation, token_sum_divisor=64.0, dual_clip=2.0)
    lc, lp, lb, adv, mask = _inputs(2)
    # Two sequences per row: columns [0, 12) and [12, 32).
    seq_index = np.where(np.arange(T) < 12, 0, 1)[None, :] + 2 * np.arange(R)[:, None]
    n_seqs = len(np.unique(seq_index[mask > 0]))
    norm = loss_normalizer(cfg, int(mask.sum()), n_seqs)

    def loss_of(lc_, rows):
        fixed = (lp[rows], lb[rows], adv[rows], mask[rows])
        return policy_loss(cfg, lc_, *fixed, norm, seq_index[rows])

    full, full_stats = loss_of(lc, slice(None))
    parts = [loss_of(lc[rows], rows) for rows in (slice(0, 1), slice(1, 4))]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], full, rtol=1e-6)
    acc = accumulate_stats(parts[0][1], parts[1][1])
    for k in full_stats:
        np.testing.assert_allclose(acc[k], full_stats[k], rtol=1e-6)
    g_full = jax.grad(lambda x: loss_of(x, slice(None))[0])(lc)
    g_parts = [
        jax.grad(lambda x, r=rows: loss_of(x, r)[0])(lc[rows])
        for rows in (slice(0, 1), slice(1, 4))
    ]
    np.testing.assert_allclose(np.concatenate(g_parts), g_full, rtol=1e-6)

    # The aggregate itself, from the NumPy per-token losses.
    tok, _ = _reference(cfg, lc, lp, lb, adv, mask)
    if aggregation == "seq_mean_token_mean":
        seqs = np.unique(seq_index[mask > 0])
        expected = (
            sum(tok[seq_index == s].sum() / mask[seq_index == s].sum() for s in seqs) / n_seqs
        )
    else:
        expected = tok.sum() / norm
    assert (
        norm == {"token_mean": mask.sum(), "seq_mean_token_mean": 8, "token_sum": 64.0}[aggregation]
    )
    np.testing.assert_allclose(full, expected, rtol=1e-5)


def test_loss_normalizer_and_summary():
    assert loss_normalizer(LossConfig(), 0, 0) == 1.0
    assert loss_normalizer(LossConfig(), 120, 4) == 120.0
    assert loss_normalizer(LossConfig(aggregation="seq_mean_token_mean"), 120, 4) == 4.0
    assert (
        loss_normalizer(LossConfig(aggregation="token_sum", token_sum_divisor=8192), 12, 4)
        == 8192.0
    )
    stats = {
        "n_tokens": jnp.float32(4),
        "clip_frac": jnp.float32(1),
        "behav_weight_max": jnp.float32(3.5),
    }
    assert summarize_stats(stats) == {"n_tokens": 4.0, "clip_frac": 0.25, "behav_weight_max": 3.5}


def test_masked_positions_cannot_poison_the_gradient():
    lc, lp, lb, adv, mask = _inputs(3)
    lc = np.where(mask > 0, lc, 1e4).astype(np.float32)  # exp would overflow if not masked
    lp = np.where(mask > 0, lp, -1e4).astype(np.float32)
    loss, grad = jax.value_and_grad(
        lambda x: policy_loss(LossConfig(), x, lp, lb, adv, mask, 9.0)[0]
    )(lc)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert (np.asarray(grad)[mask == 0] == 0).all()


def test_loglinear_proximal_logprobs():
    lb = jnp.full((5,), -1.0)
    lc = jnp.full((5,), -2.0)
    versions = jnp.array([3, 7, 8, -1, 5])
    # v_theta = 8, v_prox = 7: alpha = 4/5, 0, 0 (v_b == v_theta), 0 (masked), 2/3.
    got = loglinear_proximal_logprobs(lc, lb, versions, 8)
    np.testing.assert_allclose(got, [-1.8, -1.0, -1.0, -1.0, -1 - 2 / 3], rtol=1e-6)
    grad = jax.grad(lambda x: loglinear_proximal_logprobs(x, lb, versions, 8).sum())(lc)
    np.testing.assert_array_equal(grad, 0.0)


def test_config_validation():
    assert from_dict(LossConfig, {"behav_weight_cap": None}).behav_weight_cap is None
    assert LossConfig().needs_proximal and not LossConfig(policy_loss="ppo").needs_proximal
    for data, msg in [
        (
            {"policy_loss": "grpo"},
            "policy_loss 'grpo' is not registered; choose one of decoupled_ppo, ppo",
        ),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
        ({"behav_weight_cap": 0.5}, "behav_weight_cap must be >= 1"),
        ({"eps_clip_low": 1.2}, "eps_clip_low must be in"),
        ({"policy_loss": "ppo", "prox_logp": "loglinear"}, "loglinear needs a decoupled"),
        ({"behav_cap_mode": "clip"}, "behav_cap_mode"),
        ({"aggregation": "seq_sum"}, "aggregation"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            from_dict(LossConfig, data)
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="needs prox_logp"):
        policy_loss(LossConfig(), z, None, z, z, z, 1.0)
