"""Advantage estimators, reward shaping, overlong penalty and KL terms on hand-worked numbers."""

import numpy as np
import pytest

from areal_jax.config import ConfigError, from_dict
from areal_jax.rl.advantages import (
    AdvantageConfig,
    compute_advantages,
    kl_penalty,
    kl_reward_to_go,
    overlong_penalty,
    register_advantage,
    shape_rewards,
    trajectory_advantages,
)
from areal_jax.trajectory import Trajectory, TrajectoryGroup

GROUPS = [[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 9.0]]


def _check(name, expected, **kw):
    got = compute_advantages(name, GROUPS, **kw)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_grpo_unbiased_std_is_the_default():
    # Group 1: mean 0.25, squared deviations sum 0.75, unbiased std sqrt(0.75 / 3) = 0.5.
    # Group 2: mean 5, deviations -3, -1, 4, squared sum 26, unbiased std sqrt(13) = 3.6055513.
    expected = [[1.5, -0.5, -0.5, -0.5], [-0.8320503, -0.2773501, 1.1094004]]
    _check("grpo", expected)
    _check("grpo", expected, group_std="unbiased")
    # All-equal rewards give zero advantages, not a division by zero.
    np.testing.assert_array_equal(compute_advantages("grpo", [[1.0, 1.0, 1.0]])[0], [0, 0, 0])


def test_grpo_population_std():
    # Group 1: population std sqrt(0.75 / 4) = 0.4330127; group 2: sqrt(26 / 3) = 2.9439203.
    _check(
        "grpo",
        [[1.7320508, -0.5773503, -0.5773503, -0.5773503], [-1.0190493, -0.3396831, 1.3587324]],
        group_std="population",
    )


@pytest.mark.parametrize("group_std", ["unbiased", "population"])
def test_grpo_group_of_one_gets_zero_advantage(group_std):
    got = compute_advantages("grpo", [[0.7], [1.0, 3.0]], group_std=group_std)
    assert np.all(np.isfinite(np.concatenate(got)))
    np.testing.assert_array_equal(got[0], [0.0])
    std = {"unbiased": np.sqrt(2.0), "population": 1.0}[group_std]
    np.testing.assert_allclose(got[1], [-1 / std, 1 / std], rtol=1e-5)


def test_group_std_option_is_validated():
    with pytest.raises(ValueError, match="group_std must be unbiased or population"):
        compute_advantages("grpo", GROUPS, group_std="sample")
    assert AdvantageConfig().group_std == "unbiased"
    assert from_dict(AdvantageConfig, {"group_std": "population"}).group_std == "population"
    with pytest.raises(ConfigError, match="group_std"):
        from_dict(AdvantageConfig, {"group_std": "biased"})


def test_dr_grpo():
    _check("dr_grpo", [[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 4.0]])


def test_rloo():
    # r - mean(others): 1 - 0, 0 - 1/3; 2 - 6.5, 4 - 5.5, 9 - 3.
    _check("rloo", [[1.0, -1 / 3, -1 / 3, -1 / 3], [-4.5, -1.5, 6.0]])
    with pytest.raises(ValueError, match="group 1 has 1"):
        compute_advantages("rloo", [[1.0, 2.0], [3.0]])


def test_reinforce_batch_mean():
    # Batch mean 16 / 7.
    _check("reinforce", [[-9 / 7, -16 / 7, -16 / 7, -16 / 7], [-2 / 7, 12 / 7, 47 / 7]])


def test_registry():
    @register_advantage("test_median_baseline")
    def _median(groups, *, eps, std_ddof):
        return [g - np.median(g) for g in groups]

    np.testing.assert_allclose(
        compute_advantages("test_median_baseline", [[1.0, 5.0, 2.0]])[0], [-1.0, 3.0, 0.0]
    )
    assert from_dict(AdvantageConfig, {"estimator": "test_median_baseline"}).estimator
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(_median)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo"):
        compute_advantages("ppo", GROUPS)
    with pytest.raises(ValueError, match=r"rewards_per_group\[1\] must be a non-empty"):
        compute_advantages("grpo", [[1.0], []])
    with pytest.raises(ValueError, match=r"rewards_per_group\[0\] holds a non-finite"):
        compute_advantages("grpo", [[1.0, float("nan")]])


def test_shape_rewards():
    # (r + 1) * 2 = -4, 3, 22, clipped to [-5, 5].
    np.testing.assert_allclose(shape_rewards([-3.0, 0.5, 10.0], 1.0, 2.0, 5.0), [-4.0, 3.0, 5.0])
    np.testing.assert_allclose(shape_rewards([-3.0, 10.0], 0.0, 0.5), [-1.5, 5.0])


def test_overlong_penalty():
    # L_max 100, window 20: free up to 80, then -(L - 80) / 20 * f.
    np.testing.assert_allclose(
        overlong_penalty([50, 80, 85, 90, 100], 100, 20), [0, 0, -0.25, -0.5, -1.0]
    )
    np.testing.assert_allclose(overlong_penalty([90, 100], 100, 20, factor=0.5), [-0.25, -0.5])
    with pytest.raises(ValueError, match="overlong window must be in"):
        overlong_penalty([1], 10, 11)


def test_kl_estimators():
    # lp - lr = 0.5: k1 0.5, k2 0.125, k3 exp(-0.5) + 0.5 - 1 = 0.1065307.
    lp, lr = np.array([-1.0, -2.0]), np.array([-1.5, -2.0])
    np.testing.assert_allclose(kl_penalty(lp, lr, "k1"), [0.5, 0.0], atol=1e-7)
    np.testing.assert_allclose(kl_penalty(lp, lr, "k2"), [0.125, 0.0], atol=1e-7)
    np.testing.assert_allclose(kl_penalty(lp, lr, "k3"), [0.1065307, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, lr, "k4")


def test_kl_reward_to_go():
    # -0.5 * [0.1, 0.2, 0 (masked), 0.4], summed from each token to the end.
    np.testing.assert_allclose(
        kl_reward_to_go([0.1, 0.2, 0.3, 0.4], [1, 1, 0, 1], 0.5), [-0.35, -0.3, -0.2, -0.2]
    )


def _t(n_out, reward, mask=None):
    return Trajectory(
        prompt_ids=[1, 2], output_ids=np.arange(n_out) + 3, behav_logprobs=np.zeros(n_out),
        versions=np.zeros(n_out), reward=reward, output_mask=mask,
    )  # fmt: skip


def _groups():
    return [
        TrajectoryGroup("a", [_t(3, 1.0), _t(4, 0.0, mask=[1, 1, 0, 1])]),
        TrajectoryGroup("b", [_t(1, 0.0), _t(2, 0.0)]),
    ]


def test_trajectory_advantages_pipeline():
    cfg = AdvantageConfig(
        estimator="grpo", reward_scale=2.0, reward_clip=1.5, overlong_window=2, kl_beta=0.1,
        group_std="population",
    )  # fmt: skip
    kl = [np.array([1.0, 2.0, 3.0]), np.zeros(4), np.zeros(1), np.zeros(2)]
    got = trajectory_advantages(_groups(), cfg, max_new_tokens=4, kl=kl)
    # Overlong (L_max 4, W 2): L=3 -> -0.5, L=4 -> -1, L<=2 -> 0. Rewards 0.5, -1, 0, 0.
    # Shaped *2, clip 1.5: 1.0, -1.5, 0, 0. GRPO group a: mean -0.25, std 1.25 -> +-1.
    # KL reward-to-go of trajectory 0: -0.1 * [6, 5, 3]; masked token of trajectory 1 -> 0.
    expected = [[0.4, 0.5, 0.7], [-1.0, -1.0, 0.0, -1.0], [0.0], [0.0, 0.0]]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

    normed = trajectory_advantages(
        _groups(), AdvantageConfig(**{**cfg.__dict__, "normalize_batch": True}),
        max_new_tokens=4, kl=kl,
    )  # fmt: skip
    valid = np.array([0.4, 0.5, 0.7, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0])
    ref = [(np.array(e) - valid.mean()) / (valid.std() + 1e-6) for e in expected]
    ref[1][2] = 0.0
    for g, e in zip(normed, ref, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    trained = np.concatenate([normed[0], np.delete(normed[1], 2), normed[2], normed[3]])
    np.testing.assert_allclose([trained.mean(), trained.std()], [0.0, 1.0], atol=1e-5)


def test_trajectory_advantages_use_the_configured_group_std():
    # Group a: rewards 1, 0 -> deviations +-0.5; unbiased std sqrt(0.5) -> +-0.7071068,
    # population std 0.5 -> +-1. Group b: rewards 0, 0 -> 0.
    for cfg, a in ((AdvantageConfig(), 0.7071068), (AdvantageConfig(group_std="population"), 1.0)):
        got = trajectory_advantages(_groups(), cfg)
        expected = [[a] * 3, [-a, -a, 0.0, -a], [0.0], [0.0, 0.0]]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_trajectory_advantages_errors():
    with pytest.raises(ValueError, match="needs max_new_tokens"):
        trajectory_advantages(_groups(), AdvantageConfig(overlong_window=2))
    with pytest.raises(ValueError, match="needs per-token KL"):
        trajectory_advantages(_groups(), AdvantageConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match=r"kl\[1\] has shape \(3,\), expected \(4,\)"):
        trajectory_advantages(
            _groups(), AdvantageConfig(kl_beta=0.1),
            kl=[np.zeros(3), np.zeros(3), np.zeros(1), np.zeros(2)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="group 0 \\('e'\\) has no trajectories"):
        trajectory_advantages([TrajectoryGroup("e", [])], AdvantageConfig())
    # Advantages read mask == 1, packing and the token count mask != 0: a 2 was trained with
    # advantage 0 yet counted in the loss's normaliser.
    with pytest.raises(ValueError, match=r"output_mask must hold only 0 .* got values \[0, 1, 2\]"):
        Trajectory([1], [2, 3, 4], [0.0] * 3, [0] * 3, output_mask=[1, 2, 0])


def test_config_validation():
    assert from_dict(AdvantageConfig, {}) == AdvantageConfig()
    with pytest.raises(ConfigError, match="estimator 'gae' is not registered"):
        from_dict(AdvantageConfig, {"estimator": "gae"})
    with pytest.raises(ConfigError, match="kl_estimator"):
        from_dict(AdvantageConfig, {"kl_estimator": "k5"})
    with pytest.raises(ConfigError, match="reward_clip must be > 0"):
        from_dict(AdvantageConfig, {"reward_clip": 0})
    with pytest.raises(ConfigError, match="unknown config key kl_coef"):
        from_dict(AdvantageConfig, {"kl_coef": 0.1})
