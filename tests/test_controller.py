"""The asynchronous loop over real gRPC: staleness bound, nothing lost or doubled, server death,
resume. In-process rollout servers run the arithmetic engine double; the trainer is a recording
double whose versions advance like the real one's."""

import asyncio

import pytest
from _loop_kit import RecordingTrainer, assert_nothing_lost, config, exports_dir, items
from _loop_kit import run_on_servers, trained_ids
from _rollout_fakes import ArithmeticEngine


@pytest.mark.parametrize("mode,eta", [("async", 1), ("async", 0), ("sync", 0)])
def test_loop_respects_staleness_and_loses_nothing(tmp_path, mode, eta):
    prompts = items(40)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.002) for _ in range(2)],
                   config(tmp_path, {"mode": mode, "max_staleness": eta}), trainer, prompts, 6)
    assert len(trainer.batches) == 6
    for version, groups in trainer.batches:
        assert len(groups) == 3
        for g in groups:
            assert len(g.trajectories) == 2
            for t in g.trajectories:
                assert len(t.output_ids) > 0
                # Token staleness never exceeds the bound.
                assert version - int(t.versions.min()) <= eta, (version, t.versions)
    ids = trained_ids(trainer)
    assert len(ids) == len(set(ids)) == 18
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    # Checkpoints every 2 versions record the data position and the untrained groups.
    assert [v for v, _ in trainer.saved] == [2, 4, 6]


def test_the_trainer_is_idle_only_while_the_loop_waits_for_a_batch(tmp_path):
    """Programs compile ahead only in the trainer's idle windows: the loop opens them while no
    batch is ready, never while a step trains."""
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.01)], config(tmp_path), trainer,
                   items(40), 4)
    assert trainer.idle_spans  # slow generation: the loop waited for batches
    for start, end in trainer.idle_spans:
        for t0, t1 in trainer.train_spans:
            assert end <= t0 or start >= t1, "an idle window overlapped a train step"


def test_dead_server_groups_are_resubmitted_elsewhere(tmp_path):
    prompts = items(60)
    trainer = RecordingTrainer(exports_dir(tmp_path))

    async def kill_one(loop, pool, servers):
        while len(trainer.batches) < 1:
            await asyncio.sleep(0.01)
        await servers[0].stop(grace=0)

    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.01) for _ in range(2)],
                          config(tmp_path, {"max_staleness": 2}), trainer, prompts, 5,
                          during=kill_one)
    assert len(loop.live_at_end) == 1
    ids = trained_ids(trainer)
    assert len(ids) == len(set(ids)) == 15
    assert loop.gate.submitted == loop.gate.in_flight + len(loop._buffer) + 15
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_resume_resubmits_pending_groups_first(tmp_path):
    prompts = items(30)
    cfg = config(tmp_path, {"max_staleness": 1})
    first = RecordingTrainer(exports_dir(tmp_path))
    run_on_servers(tmp_path, [ArithmeticEngine()], cfg, first, prompts, 2)
    version, state = first.saved[-1]
    assert version == 2 and state["pending"], state
    second = RecordingTrainer(exports_dir(tmp_path), version=2)
    run_on_servers(tmp_path, [ArithmeticEngine()], cfg, second, prompts, 6, state=state)
    resumed = trained_ids(second)
    # Every group pending at the checkpoint is trained after the restart, nothing trained
    # before is trained again, and the data position carries on.
    assert set(state["pending"]) <= set(resumed)
    assert not set(resumed) & set(trained_ids(first))
    assert len(set(resumed)) == len(resumed) == 12
    # Request ids (and the sampling seeds drawn from them) go on from the checkpoint, as
    # without the restart, instead of repeating the first run's from 0.
    indices = [int(g.group_id.split(":", 1)[0]) for _, groups in second.batches for g in groups]
    assert state["next_request"] > 0 and min(indices) >= state["next_request"]
