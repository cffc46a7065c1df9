"""The shape forecast: shapes from lengths alone, ranked by how often drawn batches need them,
and the trainer compiling the forecast's shapes before older guesses."""

import logging

import numpy as np
import pytest

from areal_jax.rl import MicroBatchConfig, neighbour_shapes
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.ahead import AheadCompiler
from areal_jax.trainer.batches import minibatch_plan, minibatch_shapes
from areal_jax.trainer.forecast import ShapeForecast
from areal_jax.trajectory import Trajectory, TrajectoryGroup

from _trainer_kit import one_device_mesh, tiny_model

BUDGET = MicroBatchConfig(token_budget=1024)  # rows of 128, 256, 512 or 1024 tokens


def _trajs(lengths):
    return [Trajectory([1], list(range(2, n + 1)), np.zeros(n - 1), np.zeros(n - 1))
            for n in lengths]


@pytest.mark.parametrize("cfg", [
    MicroBatchConfig(token_budget=1024, attention_break_even=300, reuse_tolerance=1.5),
    MicroBatchConfig(token_budget=8192, mode="fixed", num_micro_batches=3),
], ids=["dynamic", "fixed"])
def test_shapes_from_lengths_are_those_the_packed_plan_has(cfg):
    rng = np.random.default_rng(0)
    for trial in range(20):
        lengths = [int(n) for n in rng.integers(2, 700, size=int(rng.integers(4, 40)))]
        order = rng.permutation(len(lengths))
        known = {(2, 512), (4, 128)} if trial % 2 else set()
        plan = minibatch_plan(_trajs(lengths), [0.0] * len(lengths), 2, cfg, order, known)
        assert minibatch_shapes(lengths, 2, cfg, order, known) == [
            b.shape for mb in plan for b in mb]


def test_identical_groups_forecast_exactly_their_shapes_less_the_known():
    forecast = ShapeForecast(2, BUDGET, samples=4)
    assert forecast.rank(64, set()) == []  # nothing seen: nothing to forecast
    forecast.observe([[100] * 8] * 10)
    # Per minibatch of 32 x 100 tokens: 3 micro-batches of 10 sequences, 5 per row of 512
    # (as little padding as 1 row of 1024, and shorter rows), and one of 2 in rows of 128.
    shapes = [(2, 512)] * 3 + [(2, 128)]
    assert minibatch_shapes([100] * 64, 2, BUDGET, np.arange(64)) == shapes * 2
    assert forecast.rank(64, set()) == [(2, 128), (2, 512)]  # equally likely: in (R, T) order
    assert forecast.rank(64, {(2, 512)}) == [(2, 128)]


def test_shapes_are_ranked_by_how_many_drawn_batches_need_them():
    """Batches of one group: three in four draws are the short group, one the long one."""
    forecast = ShapeForecast(1, BUDGET, samples=400)
    forecast.observe([[40] * 8, [40] * 8, [40] * 8, [600] * 8])
    short = set(minibatch_shapes([40] * 8, 1, BUDGET, np.arange(8)))
    long = set(minibatch_shapes([600] * 8, 1, BUDGET, np.arange(8)))
    assert short.isdisjoint(long)
    ranked = forecast.rank(8, set())
    assert set(ranked[:len(short)]) == short and set(ranked[len(short):]) == long


def test_the_prior_informs_the_forecast_until_enough_groups_are_seen():
    """Two trajectories of 900 tokens go one per micro-batch of 1024; a group of two of 100
    packs into one micro-batch of 2 rows of 128; 900 + 100 share a row of 1024."""
    forecast = ShapeForecast(1, BUDGET, samples=64, prior_until=4)
    forecast.set_prior([1, 900, 900])  # a count under 2 tokens is no trajectory: ignored
    assert forecast.rank(2, set()) == [(1, 1024)]
    forecast.observe([[100, 100]] * 3)
    assert set(forecast.rank(2, set())) == {(1, 1024), (2, 128)}
    forecast.observe([[100, 100]])  # the fourth group: the prior is no longer drawn from
    assert forecast.rank(2, set()) == [(2, 128)]
    with pytest.raises(ValueError, match="samples"):
        ShapeForecast(1, BUDGET, samples=0)


def test_prioritised_keys_run_first_in_the_order_given():
    ran = []
    ahead = AheadCompiler(settle_s=0.0)  # jobs wait for the window below
    for key in "abcd":
        ahead.submit(key, lambda key=key: ran.append(key))
    ahead.prioritise(["d", "x", "b"])  # "x" was never queued: nothing to move
    with ahead.idle():
        assert ahead.wait_done(30)
    ahead.close()
    assert ran == ["d", "b", "a", "c"]


LADDER = MicroBatchConfig(token_budget=256, row_buckets=(32, 64, 256))


def _thread_trainer() -> Trainer:
    """A trainer of rows of 32, 64 or 256 tokens compiling ahead on a thread of its own."""
    return Trainer(TrainerConfig(lr=1e-2, ppo_n_minibatches=1, micro_batch=LADDER,
                                 compile_ahead_in="thread"),
                   mesh=one_device_mesh(), model=tiny_model(seed=7))


def _thirty_token_batch(n: int) -> list[TrajectoryGroup]:
    """One group of ``n`` trajectories of 30 tokens (a row of 32 each)."""
    return [TrajectoryGroup("p", [
        Trajectory([1, 2, 3, 4], list(range(5, 31)), np.zeros(26), np.zeros(26),
                   reward=float(i % 3)) for i in range(n)])]


def _compiled_ahead_by(trainer, caplog) -> list[str]:
    """The jobs ``trainer`` compiled ahead, in order, from its log (other tests' trainers,
    their compile threads still finishing, log the same lines)."""
    threads = {t.ident for t in trainer._ahead._threads}
    return [r.getMessage().split(" ahead in ")[0] for r in caplog.records
            if " ahead in " in r.getMessage() and r.thread in threads]


def test_expected_lengths_compile_before_older_guesses_and_spare_the_first_step(caplog):
    """Sketches queue long-row shapes first; lengths like the batches to come (30 tokens)
    put their shape (6 rows of 32) ahead of them, and the first step compiles no shape."""
    trainer = _thread_trainer()
    sketched = trainer.compile_ahead_for([[60] * 4])
    assert sketched[0] == (4, 64) and (6, 32) not in sketched
    assert trainer.expect_lengths([30] * 20, 6) == [(6, 32)]
    with pytest.raises(ValueError, match="lengths: every trajectory needs >= 2 tokens"):
        trainer.expect_lengths([30, 1], 6)
    with caplog.at_level(logging.INFO, logger="areal_jax.trainer"):
        assert trainer.wait_compiled_ahead(300)
    compiled = _compiled_ahead_by(trainer, caplog)
    first = compiled.index("compiled ('train', (6, 32))")
    assert all(compiled.index(f"compiled ('train', {s})") > first for s in sketched)
    assert trainer.train_on_batch(_thirty_token_batch(6))["packing/new_shapes"] == 0.0
    trainer.close()


def test_after_a_step_the_shapes_next_to_its_own_compile_before_older_guesses(caplog):
    """A sketch of long trajectories queues long-row shapes; a step on short ones (6 rows of
    32 tokens) then puts the shapes next to its own ahead of those guesses."""
    trainer = _thread_trainer()
    sketched = trainer.compile_ahead_for([[200] * 2])
    with caplog.at_level(logging.INFO, logger="areal_jax.trainer"):
        assert trainer.train_on_batch(_thirty_token_batch(6))["packing/new_shapes"] == 1
        assert trainer.wait_compiled_ahead(300)
    neighbours = neighbour_shapes({(6, 32)}, LADDER)
    guesses = [s for s in sketched if s not in neighbours]
    assert neighbours and guesses
    compiled = _compiled_ahead_by(trainer, caplog)
    position = {s: compiled.index(f"compiled ('train', {s})") for s in neighbours + guesses}
    assert max(position[s] for s in neighbours) < min(position[s] for s in guesses)
    trainer.close()


def test_a_step_takes_parts_of_a_known_shape_and_the_new_one_once_compiled_ahead():
    # A batch a little larger than those before compiled its new shape inside the step; now it
    # runs as two micro-batches of the shape it knows, the new shape compiles ahead, and the
    # next such batch uses it.
    trainer = _thread_trainer()

    first = trainer.train_on_batch(_thirty_token_batch(4))  # 4 rows of 32
    assert (first["packing/new_shapes"], first["packing/micro_batches"]) == (1.0, 1.0)
    parts = trainer.train_on_batch(_thirty_token_batch(8))  # best: 8 rows of 32, new; (4, 32) known
    assert (parts["packing/new_shapes"], parts["packing/micro_batches"]) == (0.0, 2.0)
    assert trainer.wait_compiled_ahead(300)
    assert ("train", (8, 32)) in trainer._ahead.compiled()
    whole = trainer.train_on_batch(_thirty_token_batch(8))
    assert (whole["packing/new_shapes"], whole["packing/micro_batches"]) == (0.0, 1.0)
    trainer.close()


def test_a_shape_that_failed_to_compile_ahead_is_compiled_by_the_step_not_cut_for_good():
    trainer = _thread_trainer()
    compile_for = trainer._programs.compile

    def failing_for_eight_rows(key):
        if key == ("train", (8, 32)):
            raise RuntimeError("no memory for it")
        return compile_for(key)

    trainer._programs.compile = failing_for_eight_rows

    trainer.train_on_batch(_thirty_token_batch(4))
    assert trainer.train_on_batch(_thirty_token_batch(8))["packing/micro_batches"] == 2.0  # parts, for now
    assert trainer.wait_compiled_ahead(300)
    assert ("train", (8, 32)) in trainer._ahead.failed()
    whole = trainer.train_on_batch(_thirty_token_batch(8))  # the step compiles it, as without compile-ahead
    assert (whole["packing/new_shapes"], whole["packing/micro_batches"]) == (1.0, 1.0)
    trainer.close()
