"""Dynamic micro-batching (Algorithm 1), minibatch splits and packing into [R, T] rows."""

import dataclasses

import numpy as np
import pytest

from areal_jax.config import ConfigError, from_dict
from areal_jax.rl.packing import (
    MAX_SPLIT,
    MicroBatchConfig,
    choose_row_layout,
    default_row_buckets,
    micro_batch_layouts,
    neighbour_shapes,
    pack_micro_batch,
    pack_micro_batches,
    plan_micro_batches,
    possible_shapes,
    row_count_bucket,
    split_minibatches,
    unpack_outputs,
)
from areal_jax.trajectory import Trajectory, TrajectoryGroup


def _traj(n_prompt, n_out, seed=0, reward=0.0):
    rng = np.random.default_rng(seed)
    return Trajectory(
        prompt_ids=rng.integers(1, 1000, n_prompt),
        output_ids=rng.integers(1, 1000, n_out),
        behav_logprobs=-rng.random(n_out),
        versions=rng.integers(0, 5, n_out),
        reward=reward,
        output_mask=(rng.random(n_out) < 0.8).astype(np.int32),
    )


def test_plan_hand_example():
    # Descending: 8 (i2), 7 (i4), 5 (i0), 3 (i1), 2 (i3); budget 10.
    # 8 opens mb0; 7 and 5 fit nowhere and open mb1, mb2; 3 fits mb1 (7) and mb2 (5): both hold
    # one sequence, mb2 has fewer tokens; 2 fits all, mb0 and mb1 hold fewest, mb1 lighter.
    assert plan_micro_batches([5, 3, 8, 2, 7], 10) == [[2], [3, 4], [0, 1]]
    # min_count=4 forces a fourth micro-batch for the 3; the 2 joins the lightest (the 3's).
    assert plan_micro_batches([5, 3, 8, 2, 7], 10, min_count=4) == [[2], [4], [0], [1, 3]]


def test_plan_random_invariants():
    rng = np.random.default_rng(0)
    for _ in range(200):
        budget = int(rng.integers(16, 256))
        lengths = rng.integers(1, budget + 1, int(rng.integers(1, 40))).tolist()
        min_count = int(rng.integers(1, len(lengths) + 1))
        plan = plan_micro_batches(lengths, budget, min_count)
        placed = sorted(i for mb in plan for i in mb)
        assert placed == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= budget for mb in plan)
        assert len(plan) >= min_count


def test_plan_errors():
    with pytest.raises(ValueError, match=r"sequence 3 has 300 tokens.*budget 256"):
        plan_micro_batches([10, 20, 30, 300], 256)
    with pytest.raises(ValueError, match="min_count=5"):
        plan_micro_batches([1, 2, 3], 10, min_count=5)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        plan_micro_batches([1, 0], 10)


def test_split_minibatches_balanced_and_whole_groups():
    sizes = [9, 3, 7, 5, 4, 6]  # tokens per group: one trajectory of (1 prompt + s-1 output)
    groups = [TrajectoryGroup(f"g{i}", [_traj(1, s - 1, seed=i)]) for i, s in enumerate(sizes)]
    parts = split_minibatches(groups, 2)
    # Largest first into the lighter part: 9->A, 7->B, 6->B(7<9), 5->A(13 vs 14), 4->A? A=14,
    # B=13 -> B, 3 -> A (14 vs 17). A = {9, 5, 3} = 17, B = {7, 6, 4} = 17, input order kept.
    assert [[g.group_id for g in p] for p in parts] == [["g0", "g1", "g3"], ["g2", "g4", "g5"]]
    trajs = [g.trajectories[0] for g in groups]
    assert [len(p) for p in split_minibatches(trajs, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="cannot split 6 items into 7"):
        split_minibatches(groups, 7)


def test_default_row_buckets():
    assert default_row_buckets(1024) == (128, 256, 512, 1024)
    assert default_row_buckets(1000) == (128, 256, 512, 1024)
    assert default_row_buckets(3000) == (128, 256, 512, 1024, 2048, 3072)
    assert default_row_buckets(100) == (128,)


def test_pack_hand_example():
    a = Trajectory(
        prompt_ids=[11, 12], output_ids=[13, 14, 15], behav_logprobs=[-0.1, -0.2, -0.3],
        versions=[3, 4, 4], output_mask=[1, 0, 1],
    )  # fmt: skip
    b = Trajectory(
        prompt_ids=[21], output_ids=[22, 23], behav_logprobs=[-0.5, -0.6], versions=[5, 5]
    )
    # Lengths 5 and 3 fit one row of T=8 (area 8 < 16 for T=16).
    p = pack_micro_batch([a, b], [2.0, np.array([1.5, -1.5])], buckets=(8, 16))
    assert p.shape == (1, 8)
    np.testing.assert_array_equal(p.tokens, [[11, 12, 13, 14, 15, 21, 22, 23]])
    np.testing.assert_array_equal(p.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(p.positions, [[0, 1, 2, 3, 4, 0, 1, 2]])
    np.testing.assert_array_equal(p.targets, [[12, 13, 14, 15, 0, 22, 23, 0]])
    np.testing.assert_array_equal(p.loss_mask, [[0, 1, 0, 1, 0, 1, 1, 0]])
    np.testing.assert_allclose(p.behav_logprobs, [[0, -0.1, 0, -0.3, 0, -0.5, -0.6, 0]])
    np.testing.assert_array_equal(p.versions, [[-1, 3, -1, 4, -1, 5, 5, -1]])
    np.testing.assert_allclose(p.advantages, [[0, 2.0, 0, 2.0, 0, 1.5, -1.5, 0]])
    np.testing.assert_array_equal(p.seq_index, [[0, 0, 0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(p.placements, [[0, 0, 2, 3], [0, 5, 1, 2]])
    assert p.n_valid_tokens == 4 and p.n_sequences == 2
    assert p.loss_mask.dtype == np.float32 and p.tokens.dtype == np.int32

    out = unpack_outputs(np.arange(8).reshape(1, 8), p.placements)
    np.testing.assert_array_equal(out[0], [1, 2, 3])
    np.testing.assert_array_equal(out[1], [5, 6])

    # row_multiple=2 pads with a whole row of padding.
    p2 = pack_micro_batch([a, b], [2.0, 1.0], buckets=(8, 16), row_multiple=2)
    assert p2.shape == (2, 8)
    assert (p2.segment_ids[1] == 0).all() and (p2.seq_index[1] == -1).all()
    assert (p2.versions[1] == -1).all() and p2.loss_mask[1].sum() == 0


def test_pack_row_layout_minimises_padded_area():
    trajs = [_traj(10, 50, seed=i) for i in range(4)]  # four sequences of 60 tokens
    # T=100 holds one per row: 3 rows, bucketed to 4 (area 400); T=200 holds all three (200).
    assert pack_micro_batch(trajs[:3], [0.0] * 3, buckets=(100, 200)).shape == (1, 200)
    # One sequence: (1, 100) beats (1, 200).
    assert pack_micro_batch(trajs[:1], [0.0], buckets=(100, 200)).shape == (1, 100)
    # T=128 gives 2 rows of two (256), T=256 one row of four (256): a tie goes to the smaller T.
    assert pack_micro_batch(trajs, [0.0] * 4, buckets=(128, 256)).shape == (2, 128)


def test_pack_errors():
    a = _traj(3, 4)
    with pytest.raises(ValueError, match=r"advantages\[1\] has shape \(3,\)"):
        pack_micro_batch([a, _traj(2, 2)], [1.0, np.zeros(3)], buckets=(16,))
    with pytest.raises(ValueError, match="exceeds the largest row bucket 4"):
        pack_micro_batch([a], [1.0], buckets=(4,))
    with pytest.raises(ValueError, match="advantages has 1 entries for 2"):
        pack_micro_batches([a, a], [1.0], MicroBatchConfig(token_budget=64))


def test_config_validation():
    cfg = from_dict(MicroBatchConfig, {"token_budget": 512, "row_buckets": [128, 512]})
    assert cfg.buckets == (128, 512)
    with pytest.raises(ConfigError, match="largest bucket 256 is below token_budget 512"):
        from_dict(MicroBatchConfig, {"token_budget": 512, "row_buckets": [128, 256]})
    with pytest.raises(ConfigError, match="strictly ascending"):
        from_dict(MicroBatchConfig, {"token_budget": 64, "row_buckets": [128, 64]})
    with pytest.raises(ConfigError, match="row_multiple must be >= 1"):
        from_dict(MicroBatchConfig, {"row_multiple": 0})


def test_possible_shapes_literal():
    cfg = MicroBatchConfig(token_budget=1024, row_multiple=2)
    assert possible_shapes(cfg) == {
        (2, 128), (4, 128), (6, 128), (8, 128), (12, 128), (16, 128),
        (2, 256), (4, 256), (6, 256), (8, 256),
        (2, 512), (4, 512),
        (2, 1024),
    }  # fmt: skip


def test_neighbour_shapes_literal():
    """One rung more rows at the same length first, then at the next bucket the rows holding as
    many tokens; only shapes packing can produce (at most 2 * budget / T rows), none given."""
    cfg = MicroBatchConfig(token_budget=256, row_buckets=(32, 64, 256))
    assert neighbour_shapes({(4, 32)}, cfg) == [(6, 32), (2, 64)]
    assert neighbour_shapes({(8, 64)}, cfg) == [(2, 256)]  # 12 rows of 64 hold over 512 tokens
    assert neighbour_shapes({(2, 256)}, cfg) == []  # the largest shape
    assert neighbour_shapes({(4, 32), (6, 32)}, cfg) == [(8, 32), (2, 64), (3, 64)]
    even = dataclasses.replace(cfg, row_multiple=2)
    assert neighbour_shapes({(4, 32)}, even) == [(6, 32), (2, 64)]
    assert neighbour_shapes({(2, 64)}, even) == [(4, 64), (2, 256)]


def test_row_count_ladder():
    assert [row_count_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert [row_count_bucket(n, 2) for n in (1, 2, 3, 5, 7, 9)] == [2, 2, 4, 6, 8, 12]


def test_layout_weighs_padding_against_attention_cost():
    """Nine 50-token sequences: one 512-row (area 512) or 12 rows of 64 (9 used, area 768)."""
    lengths = [50] * 9
    assert choose_row_layout(lengths, (64, 512))[0] == 512  # padded area alone
    assert choose_row_layout(lengths, (64, 512), attention_break_even=10_000)[0] == 512
    t, r, rows = choose_row_layout(lengths, (64, 512), attention_break_even=64)
    assert (t, r) == (64, 12) and len(rows) == 9  # 768 * 2 = 1536 < 512 * 9 = 4608


def test_known_shapes_are_reused_within_the_tolerance():
    lengths = [60] * 5  # best: five rows of 64 -> R = 6 (cost 384); or one row of 512
    assert choose_row_layout(lengths, (64, 512))[:2] == (64, 6)
    # A compiled (8, 64) costs 512 <= 1.4 * 384: taken, rows padded to 8.
    t, r, rows = choose_row_layout(lengths, (64, 512), known={(8, 64)}, reuse_tolerance=1.4)
    assert (t, r, len(rows)) == (64, 8, 5)
    # Beyond the tolerance, or too few rows, or another row length: the best layout.
    assert choose_row_layout(lengths, (64, 512), known={(8, 64)}, reuse_tolerance=1.3)[:2] == (64, 6)
    assert choose_row_layout(lengths, (64, 512), known={(4, 64)}, reuse_tolerance=9)[:2] == (64, 6)
    assert choose_row_layout(lengths, (64, 512), known={(1, 512)}, reuse_tolerance=1.4)[:2] == (
        512, 1)  # a known longer row: 512 <= 1.4 * 384
    assert choose_row_layout(lengths, (64, 512), known={(1, 512)}, reuse_tolerance=1.3)[:2] == (
        64, 6)
    # The cheapest of several known fits; the row multiple holds.
    known = {(8, 64), (12, 64), (2, 512)}
    assert choose_row_layout(lengths, (64, 512), known=known, reuse_tolerance=2)[:2] == (64, 8)
    assert choose_row_layout(lengths, (64, 512), row_multiple=3, known={(8, 64)},
                             reuse_tolerance=9)[:2] == (64, 6)
    with pytest.raises(ValueError, match="reuse_tolerance"):
        MicroBatchConfig(reuse_tolerance=0.9)


def test_a_micro_batch_no_known_shape_holds_is_cut_into_parts_of_one_that_does():
    # A new shape compiles inside the step (seconds, against a step's tenths); parts of a
    # compiled one cost no more within the tolerance, and the new shape compiles ahead.
    cfg = MicroBatchConfig(token_budget=4096, row_buckets=(128, 256, 4096))
    lengths = [100] * 16  # best: 16 rows of 128

    def shapes(known, split=True, config=cfg):
        return [shape for _, shape, _ in micro_batch_layouts(lengths, config, known, split)]

    # Not cut by default: the shape worth compiling.
    assert [shape for _, shape, _ in micro_batch_layouts(lengths, cfg, {(8, 128)})] == [(16, 128)]
    layouts = micro_batch_layouts(lengths, cfg, {(8, 128)}, split=True)
    assert [shape for _, shape, _ in layouts] == [(8, 128), (8, 128)]
    members = [i for m, _, _ in layouts for i in m]
    assert sorted(members) == list(range(16))  # every sequence once
    assert all(len(rows) == 8 and sorted(p for row in rows for p in row) == list(range(len(m)))
               for m, _, rows in layouts)
    assert MAX_SPLIT == 4 and shapes({(2, 128)}) == [(16, 128)]  # 8 parts: too many
    assert shapes({(4, 128), (8, 128)}) == [(8, 128), (8, 128)]  # the cheapest parts
    # Parts must cost at most reuse_tolerance x the best: rows of 256 weigh more with attention.
    attention = dataclasses.replace(cfg, attention_break_even=128)  # best costs 16*128*2
    assert shapes({(4, 256)}, config=attention) == [(4, 256)] * 2  # 2 x 4*256*3 <= 1.5x
    tight = dataclasses.replace(attention, reuse_tolerance=1.2)
    assert shapes({(4, 256)}, config=tight) == [(16, 128)]
    fixed = dataclasses.replace(cfg, mode="fixed", num_micro_batches=1)
    assert shapes({(8, 128)}, config=fixed) == [(16, 128)]  # the baseline is never cut


def test_random_minibatches_shapes_bounded_and_content_exact():
    cfg = MicroBatchConfig(token_budget=1024, min_micro_batches=2, row_multiple=2)
    allowed = possible_shapes(cfg)
    rng = np.random.default_rng(1)
    seen = set()
    for trial in range(60):
        n = int(rng.integers(2, 24))
        trajs = [
            _traj(int(rng.integers(1, 64)), int(rng.integers(0, 700)), seed=trial * 100 + i)
            for i in range(n)
        ]
        advs = [
            rng.normal(size=len(t.output_ids)) if i % 2 else float(i) for i, t in enumerate(trajs)
        ]
        batches = pack_micro_batches(trajs, advs, cfg)
        assert len(batches) >= cfg.min_micro_batches
        placed = sorted(int(i) for b in batches for i in b.traj_index)
        assert placed == list(range(n))
        for b in batches:
            seen.add(b.shape)
            assert b.shape in allowed
            assert sum(trajs[g].length for g in b.traj_index) <= cfg.token_budget
            n_valid = 0
            for local, (row, off, n_p, n_o) in enumerate(b.placements):
                t = trajs[b.traj_index[local]]
                span = slice(off, off + n_p + n_o)
                np.testing.assert_array_equal(
                    b.tokens[row, span], np.r_[t.prompt_ids, t.output_ids]
                )
                assert (b.seq_index[row, span] == local).all()
                np.testing.assert_array_equal(
                    b.targets[row, off : off + n_p + n_o - 1],
                    b.tokens[row, off + 1 : off + n_p + n_o],
                )
                assert b.targets[row, off + n_p + n_o - 1] == 0
                n_valid += int(t.output_mask.sum())
            assert b.n_valid_tokens == n_valid
            assert ((b.segment_ids > 0) == (b.seq_index >= 0)).all()
            assert (b.loss_mask[b.seq_index < 0] == 0).all()
    assert len(seen) <= len(allowed)
    assert len(seen) >= 3  # the random batches really did use several buckets


def test_fixed_mode_rows_are_sequences_padded_to_the_longest():
    lengths = [(3, 5), (2, 2), (4, 20), (1, 6), (5, 3), (2, 9), (6, 1)]  # (prompt, output)
    trajs = [_traj(p, o, seed=i) for i, (p, o) in enumerate(lengths)]
    cfg = MicroBatchConfig(token_budget=96, row_buckets=(16, 32, 96), mode="fixed",
                           num_micro_batches=3)
    batches = pack_micro_batches(trajs, [float(i) for i in range(7)], cfg)
    # In order, sizes 3, 2, 2; T is the smallest bucket over the longest; R on the row ladder.
    assert [b.traj_index.tolist() for b in batches] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [b.shape for b in batches] == [(3, 32), (2, 16), (2, 16)]
    for b in batches:
        for row, g in enumerate(b.traj_index):
            t, n = trajs[g], trajs[g].length
            np.testing.assert_array_equal(b.placements[row], [row, 0, len(t.prompt_ids),
                                                              len(t.output_ids)])
            np.testing.assert_array_equal(b.tokens[row, :n], np.r_[t.prompt_ids, t.output_ids])
            assert (b.segment_ids[row, :n] == 1).all() and (b.segment_ids[row, n:] == 0).all()
            assert (b.seq_index[row, :n] == row).all() and (b.seq_index[row, n:] == -1).all()
    # More micro-batches than sequences: one sequence each.
    cfg6 = MicroBatchConfig(token_budget=96, row_buckets=(16, 32, 96), mode="fixed",
                            num_micro_batches=6)
    assert [len(b.traj_index) for b in pack_micro_batches(trajs[:2], [0.0, 0.0], cfg6)] == [1, 1]


def test_fixed_mode_carries_the_same_tokens_as_dynamic_packing():
    """Every trajectory placed once with the same per-token values, so the loss normaliser
    (valid tokens, sequences of the minibatch) and the summed gradient do not depend on it."""
    rng = np.random.default_rng(3)
    trajs = [_traj(int(rng.integers(1, 30)), int(rng.integers(1, 200)), seed=i)
             for i in range(13)]
    advs = [rng.normal(size=len(t.output_ids)) for t in trajs]
    out = {}
    for mode in ("dynamic", "fixed"):
        cfg = MicroBatchConfig(token_budget=1024, mode=mode, num_micro_batches=4)
        batches = pack_micro_batches(trajs, advs, cfg)
        per_traj = {}
        for b in batches:
            for name in ("advantages", "behav_logprobs", "versions", "loss_mask"):
                for g, v in zip(b.traj_index, unpack_outputs(getattr(b, name), b.placements)):
                    per_traj[(int(g), name)] = v
        totals = (sum(b.n_valid_tokens for b in batches), sum(b.n_sequences for b in batches))
        out[mode] = (per_traj, totals, len(batches))
    assert out["fixed"][2] == 4 and out["dynamic"][2] < 4
    assert out["fixed"][1] == out["dynamic"][1]
    assert out["fixed"][0].keys() == out["dynamic"][0].keys()
    for key, value in out["fixed"][0].items():
        np.testing.assert_array_equal(value, out["dynamic"][0][key])


def test_fixed_mode_errors_name_the_field():
    trajs = [_traj(10, 90, seed=i) for i in range(4)]  # 100 tokens each
    cfg = MicroBatchConfig(token_budget=256, mode="fixed", num_micro_batches=1)
    message = r"num_micro_batches=1: micro-batch 0 holds 4 sequences padded to 100 tokens, 400"
    with pytest.raises(ValueError, match=message + r".* token_budget 256"):
        pack_micro_batches(trajs, [0.0] * 4, cfg)
    two = dataclasses.replace(cfg, num_micro_batches=2)
    assert len(pack_micro_batches(trajs, [0.0] * 4, two)) == 2
    with pytest.raises(ValueError, match="no sequences to split"):
        pack_micro_batches([], [], two)
    with pytest.raises(ConfigError, match="mode: 'static' is not one of"):
        from_dict(MicroBatchConfig, {"mode": "static"})
    with pytest.raises(ValueError, match="mode must be dynamic or fixed, got 'static'"):
        MicroBatchConfig(mode="static")
    with pytest.raises(ConfigError, match="num_micro_batches must be >= 1"):
        from_dict(MicroBatchConfig, {"mode": "fixed", "num_micro_batches": 0})


def test_possible_shapes_cover_the_fixed_mode():
    cfg = MicroBatchConfig(token_budget=8, row_buckets=(2, 4, 8), mode="fixed")
    # T=2: up to 8 sequences of 1 token; T=4 (longest >= 3): 2; T=8 (longest >= 5): 1.
    assert possible_shapes(cfg) == {
        (1, 2), (2, 2), (3, 2), (4, 2), (6, 2), (8, 2), (1, 4), (2, 4), (1, 8),
    }  # fmt: skip
    rng = np.random.default_rng(4)
    for trial in range(60):
        cfg = MicroBatchConfig(token_budget=1024, mode="fixed",
                               row_multiple=int(rng.integers(1, 3)),
                               num_micro_batches=int(rng.integers(1, 6)))
        allowed = possible_shapes(cfg)
        trajs = [_traj(int(rng.integers(1, 30)), int(rng.integers(1, 220)), seed=trial * 50 + i)
                 for i in range(int(rng.integers(1, 4 * cfg.num_micro_batches + 1)))]
        for b in pack_micro_batches(trajs, [0.0] * len(trajs), cfg):
            assert b.shape in allowed


def test_fixed_and_dynamic_micro_batches_give_the_same_update():
    from _trainer_kit import (
        assert_params_close, host_params, one_device_mesh, tiny_model, toy_groups,
    )  # fmt: skip

    from areal_jax.trainer import Trainer, TrainerConfig

    model, groups = tiny_model(seed=5), toy_groups(seed=1, n_groups=3, group_size=4)
    results = []
    for mb in (MicroBatchConfig(token_budget=256, row_buckets=(256,)),
               MicroBatchConfig(token_budget=256, row_buckets=(16, 256), mode="fixed",
                                num_micro_batches=3)):
        # A large Adam eps keeps near-zero gradients linear, so summation order cannot matter.
        cfg = TrainerConfig(lr=1e-2, ppo_n_minibatches=2, micro_batch=mb, grad_clip=None,
                            adam_eps=1e-3)
        trainer = Trainer(cfg, mesh=one_device_mesh(), model=model)
        results.append((trainer.train_on_batch(groups), host_params(trainer)))
    (m_dyn, p_dyn), (m_fix, p_fix) = results
    for key in ("loss", "grad_norm", "ppo/approx_kl", "ppo/clip_frac"):
        assert m_fix[key] == pytest.approx(m_dyn[key], rel=1e-5, abs=1e-6), key
    assert_params_close(p_fix, p_dyn, atol=1e-5)  # float32 summation order; steps are ~1e-2
    assert m_dyn["grad_norm"] > 1e-3  # a real update was compared


def test_a_minibatch_with_fewer_sequences_than_min_micro_batches_gets_one_per_sequence():
    # Minibatches are balanced by tokens, not by sequence count: one long answer can be a
    # minibatch of its own next to one of many short answers. min_micro_batches then cannot be
    # met; each sequence gets a micro-batch of its own instead of the step failing.
    from areal_jax.trainer.batches import minibatch_plan

    trajs = [_traj(4, 600, seed=0)] + [_traj(4, 30, seed=i) for i in range(1, 16)]
    cfg = MicroBatchConfig(token_budget=1024, min_micro_batches=3)
    plan = minibatch_plan(trajs, [0.5] * len(trajs), 2, cfg, np.arange(len(trajs)))
    sizes = sorted(sum(len(b.traj_index) for b in mb) for mb in plan)
    assert sizes == [1, 15]
    lone = next(mb for mb in plan if sum(len(b.traj_index) for b in mb) == 1)
    assert len(lone) == 1 and list(lone[0].traj_index) == [0]
    many = next(mb for mb in plan if len(mb) > 1)
    assert len(many) >= 3
    placed = sorted(int(i) for mb in plan for b in mb for i in b.traj_index)
    assert placed == list(range(len(trajs)))
