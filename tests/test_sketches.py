"""Sketches of the first batches: drawn from the prompts, response lengths spread around
guesses that grow, deterministic; compiled for where the trainer has CPUs of its own."""

import numpy as np
import pytest
from _e2e_kit import tiny_experiment

from areal_jax.config import ConfigError, from_dict
from areal_jax.controller.rl_phase import check_trajectories_fit, compiles_first_batches
from areal_jax.controller.sketches import RESPONSE_FRACTIONS, first_batch_sketches
from areal_jax.experiment import ExperimentConfig


def test_sketches_draw_prompts_and_spread_responses_shortest_guess_first():
    prompts = [10, 20, 30]
    sketches = first_batch_sketches(prompts, batch_size=4, group_size=8, max_new_tokens=128,
                                    seed=3)
    assert sketches == first_batch_sketches(prompts, 4, 8, 128, seed=3)
    assert sketches != first_batch_sketches(prompts, 4, 8, 128, seed=4)
    assert len(sketches) == len(RESPONSE_FRACTIONS) == 4
    for fraction, sketch in zip(RESPONSE_FRACTIONS, sketches):
        assert len(sketch) == 4 * 8
        groups = np.reshape(sketch, (4, 8))
        # One prompt per group: the group's response lengths are its counts less that prompt.
        for row in groups:
            prompt = [p for p in prompts if row.min() - p >= 1 and row.max() - p <= 2 * fraction
                      * 128]
            assert prompt, row
    means = [np.mean(s) for s in sketches]
    assert means == sorted(means) and means[-1] - means[0] > 30  # 4-8 vs 32-64 new tokens


def test_responses_never_exceed_max_new_tokens_and_empty_prompts_are_refused():
    (one,) = first_batch_sketches([5], 1, 50, max_new_tokens=3)[-1:]
    assert min(one) >= 6 and max(one) <= 8
    with pytest.raises(ValueError, match="prompt_lengths is empty"):
        first_batch_sketches([], 1, 1, 8)


@pytest.mark.parametrize("changes, in_helper, expected", [
    ({}, False, False),  # local servers on the trainer's CPU: compiling would only move the work
    ({}, True, True),  # ... unless the helper compiles, at the lowest CPU priority
    ({"rollout": {"addresses": ["host:50051"]}}, False, True),
    ({"trainer_cpus": [0], "rollout": {"cpu_sets": [[1]]}}, False, True),
    ({"trainer_cpus": [0, 1], "rollout": {"cpu_sets": [[1]]}}, False, False),
    ({"trainer_cpus": [0]}, False, False),  # the servers may run anywhere, the trainer's CPU too
    ({"compile_first_batches": True}, False, True),
    ({"compile_first_batches": False}, True, False),
    ({"trainer_cpus": [0], "rollout": {"cpu_sets": [[1]]}, "compile_first_batches": False},
     False, False),
])
def test_first_batches_compile_ahead_where_that_takes_no_cpu_from_the_servers(
        tmp_path, changes, in_helper, expected):
    raw = tiny_experiment(tmp_path, total_steps=1)
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    assert compiles_first_batches(from_dict(ExperimentConfig, raw), in_helper) is expected


def test_a_run_whose_longest_trajectory_fits_no_micro_batch_is_refused_before_it_starts(
        tmp_path):
    raw = tiny_experiment(tmp_path, total_steps=1)  # token budget 1024, 16 new tokens
    cfg = from_dict(ExperimentConfig, raw)
    check_trajectories_fit(cfg, [40, 1008])  # 1008 + 16 = 1024: fits exactly
    with pytest.raises(ConfigError, match=r"token_budget \(1024\).*longest training prompt "
                       r"\(1009 tokens\).*max_new_tokens \(16\) = 1025"):
        check_trajectories_fit(cfg, [40, 1009])
    # A run with no RL versions (SFT and evaluation only) trains no trajectory: nothing to fit.
    check_trajectories_fit(from_dict(ExperimentConfig, tiny_experiment(tmp_path, 0)), [1009])


def test_a_fixed_count_run_whose_padded_micro_batch_can_pass_the_budget_is_refused(tmp_path):
    raw = tiny_experiment(tmp_path, total_steps=1)  # 2 groups of 2: 4 trajectories, 1 minibatch
    raw["trainer"]["micro_batch"].update(mode="fixed", num_micro_batches=2)
    cfg = from_dict(ExperimentConfig, raw)
    check_trajectories_fit(cfg, [40, 496])  # 2 rows of 496 + 16 = 512: 1024, the budget
    with pytest.raises(ConfigError, match=r"mode fixed: .* all take 513 tokens .* puts 2 of "
                       r"them in a micro-batch \(4 per minibatch .* = 2\), 1026 padded tokens"):
        check_trajectories_fit(cfg, [40, 497])
    raw["trainer"]["micro_batch"]["num_micro_batches"] = 4  # one row each
    check_trajectories_fit(from_dict(ExperimentConfig, raw), [40, 497])
