"""The train step: exact gradient accumulation, metric values, schedule, dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.rl import MicroBatchConfig
from areal_jax.trainer import Trainer, TrainerConfig, lr_schedule
from areal_jax.trainer.batches import minibatch_plan
from areal_jax.trainer.optimizer import decay_mask
from areal_jax.trajectory import Trajectory, TrajectoryGroup

from _trainer_kit import (
    assert_params_close, host_params, one_device_mesh, set_on_policy, tiny_model, toy_groups,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainerConfig(lr=2.0, lr_schedule="cosine", warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    lr = lr_schedule(cfg)
    got = [float(lr(c)) for c in (0, 3, 4, 8, 12, 30)]
    mid = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    np.testing.assert_allclose(got, [0.5, 2.0, 2.0, mid, 0.2, 0.2], rtol=1e-6)
    constant = lr_schedule(TrainerConfig(lr=3e-4))
    assert float(constant(0)) == pytest.approx(3e-4) and float(constant(10**6)) == pytest.approx(3e-4)


def test_weight_decay_skips_norms_and_biases(model):
    mask = decay_mask(nnx.state(model, nnx.Param))
    assert mask["embed"] and mask["lm_head"] and mask["layers"]["q_kernel"]
    assert not mask["final_norm"] and not mask["layers"]["attn_norm"]
    assert not mask["layers"]["q_bias"]


def test_splitting_a_minibatch_into_1_2_or_5_micro_batches_gives_the_same_update(model):
    groups = toy_groups(seed=0, n_groups=3, group_size=4)
    trajs = [t for g in groups for t in g.trajectories]
    results = []
    for n_micro in (1, 2, 5):
        mb = MicroBatchConfig(token_budget=256, row_buckets=(256,), min_micro_batches=n_micro)
        # 2 minibatches of 6 trajectories, each cut into exactly n_micro micro-batches.
        plan = minibatch_plan(trajs, [0.0] * len(trajs), 2, mb, np.arange(len(trajs)))
        assert [len(p) for p in plan] == [n_micro, n_micro]
        # A large Adam eps keeps tiny gradients (the key bias's is zero in exact arithmetic:
        # softmax ignores a per-query constant) in the linear regime, so rounding differences
        # of the summation order are not blown up to +-lr steps.
        cfg = TrainerConfig(lr=1e-2, ppo_n_minibatches=2, micro_batch=mb, grad_clip=None,
                            adam_eps=1e-3)
        trainer = Trainer(cfg, mesh=one_device_mesh(), model=model)
        metrics = trainer.train_on_batch(groups)
        results.append((metrics, host_params(trainer)))
    (m1, p1), *others = results
    for m, p in others:
        for key in ("loss", "grad_norm", "ppo/approx_kl", "ppo/clip_frac", "ppo/entropy"):
            assert m[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
        assert_params_close(p, p1, atol=1e-6)
    # The model was really trained (the comparison above is not between untouched weights).
    assert max(np.abs(p1[k] - np.asarray(v)).max() for k, v in _initial(model).items()) > 1e-3


def _initial(model):
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def test_metrics_on_a_hand_built_batch(model):
    temperature = 0.7
    cfg = TrainerConfig(lr=1e-3, ppo_n_minibatches=1, temperature=temperature,
                        micro_batch=MicroBatchConfig(token_budget=128, bucket_base=32))
    trainer = Trainer(cfg, mesh=one_device_mesh(), model=model)

    def traj(prompt, out, versions, reward, mask=None):
        n = len(out)
        return Trajectory(prompt, out, np.zeros(n), versions, reward=reward, output_mask=mask)

    def batch():
        return [
            TrajectoryGroup("a", [traj([5, 6, 7], [8, 9, 10, 11], [0, 0, 1, 1], 1.0),
                                  traj([5, 6, 7], [12, 13], [1, 1], 0.0)]),
            TrajectoryGroup("b", [traj([20, 21], [22, 23, 24], [0, 1, 1], 3.0, mask=[1, 0, 1]),
                                  traj([20, 21], [25, 26, 27, 28, 29], [1] * 5, 1.0)]),
        ]  # fmt: skip

    trainer.train_on_batch(batch())  # to version 1, so that version-0 tokens are stale
    assert trainer.version == 1
    groups = batch()
    set_on_policy(trainer, groups)
    capped = groups[1].trajectories[1]
    capped.behav_logprobs = capped.behav_logprobs - np.array([math.log(10.0)] * 2 + [0.0] * 3)
    entropy = _mean_entropy(trainer.model, groups, temperature)
    m = trainer.train_on_batch(groups)

    # Hand computation: 14 output tokens, 13 of them trained (one workflow token masked out).
    assert m["tokens"] == 3 + 4 + 3 + 2 + 2 + 3 + 2 + 5
    assert m["ppo/loss_tokens"] == 13
    assert m["reward/mean"] == pytest.approx(5.0 / 4)
    assert (m["response_length/mean"], m["response_length/max"]) == (3.5, 5.0)
    stale = [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # version 1 minus each trained token's
    assert m["staleness/mean"] == pytest.approx(np.mean(stale))
    assert m["staleness/max"] == 1.0
    # GRPO of rewards (1, 0) and (3, 1): deviations of ±0.5 and ±1 over the unbiased group std
    # (√0.5 and √2), so ±1/√2 in both groups.
    a = 1 / math.sqrt(2)
    adv = [a, -a, a, -a]
    assert (m["advantage/min"], m["advantage/max"]) == pytest.approx((-a, a), abs=1e-5)
    # Fresh data, one minibatch: u = 1 and w = 1 except the 2 tokens with w = 10 > cap 5.
    assert m["ppo/behav_capped_frac"] == pytest.approx(2 / 13)
    assert m["ppo/behav_weight_max"] == pytest.approx(10.0, rel=1e-4)
    assert m["ppo/behav_weight_mean"] == pytest.approx((11 + 20) / 13, rel=1e-4)
    assert m["ppo/clip_frac"] == 0.0 and m["ppo/approx_kl"] == pytest.approx(0.0, abs=1e-8)
    uncapped = [4, 2, 2, 3]  # trained tokens per trajectory whose weight is not capped
    assert m["loss"] == pytest.approx(-np.dot(adv, uncapped) / 13, abs=1e-4)
    assert m["ppo/entropy"] == pytest.approx(entropy, rel=1e-4)
    assert m["lr"] == pytest.approx(1e-3) and m["version"] == 2.0
    assert m["throughput/tokens_per_s"] > 0


def _mean_entropy(model, groups, temperature):
    """Entropy of the temperature-scaled next-token distribution, averaged over trained
    tokens, from an unpacked full-logits forward of each trajectory."""
    values = []
    for t in (t for g in groups for t in g.trajectories):
        tokens = jnp.asarray(np.concatenate([t.prompt_ids, t.output_ids])[None])
        logits = model.forward_logits(tokens, jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None])
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64) / temperature)
        n_p = len(t.prompt_ids)
        ent = -(np.exp(logp) * logp).sum(-1)[n_p - 1 : n_p - 1 + len(t.output_ids)]
        values.extend(ent[t.output_mask == 1])
    return float(np.mean(values))


def test_bfloat16_compute_keeps_fp32_master_weights(model):
    cfg = TrainerConfig(lr=1e-2, ppo_n_minibatches=1, dtype="bfloat16",
                        micro_batch=MicroBatchConfig(token_budget=128, bucket_base=32))
    trainer = Trainer(cfg, mesh=one_device_mesh(), model=model)
    groups = toy_groups(seed=5, n_groups=2, group_size=2)
    trajs = [t for g in groups for t in g.trajectories]
    bf16 = trainer.compute_logprobs(trajs)
    # Against an fp32 forward of the same weights: bf16 activations, fp32 log-softmax.
    for t, lp in zip(trajs, bf16):
        tokens = jnp.asarray(np.concatenate([t.prompt_ids, t.output_ids])[None])
        logits = model.forward_logits(tokens, jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None])
        ref = jax.nn.log_softmax(logits[0])[len(t.prompt_ids) - 1 : -1]
        ref = np.asarray(ref)[np.arange(len(t.output_ids)), t.output_ids]
        np.testing.assert_allclose(lp, ref, atol=0.1)
        assert not np.allclose(lp, ref, atol=1e-6)  # really computed in bf16
    before = host_params(trainer)
    trainer.train_on_batch(groups)
    after = host_params(trainer)
    assert all(v.dtype == np.float32 for v in after.values())
    # Updates far below bf16 resolution of the weights still land in the fp32 masters.
    assert any(0 < np.abs(after[k] - before[k]).min() < 1e-4 for k in after)
