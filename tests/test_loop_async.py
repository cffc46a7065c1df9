"""The loop as an asynchronous system, over real gRPC with in-process servers: generation never
waits for the trainer, publishing overlaps training, failed servers lose nothing and may rejoin,
invalid requests stop the run, over-stale groups are dropped on request, and a restarted
trainer takes servers that are ahead back to its version."""

import asyncio
import time

import numpy as np
import pytest
from _loop_kit import RecordingTrainer, assert_nothing_lost, config, exports_dir, items, run_loop
from _loop_kit import start_servers, trained_ids
from _rollout_fakes import ArithmeticEngine, write_checkpoint

from areal_jax.controller.ledger import RunLedger
from areal_jax.controller.loop import RolloutRejectedError
from areal_jax.controller.rollout_pool import PoolOptions, RolloutPool
from areal_jax.controller.servers import sync_servers


async def _stop(servers):
    for s in servers:
        await s.stop(grace=0.5)


def test_generation_never_waits_for_the_trainer(tmp_path):
    # The quickstart's operating point: the in-flight cap binds, not the staleness gate, and
    # generation is the bottleneck. Every slot freed while the trainer trains or publishes must
    # be refilled at once.
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.1, publish_s=0.1)
    cfg = config(tmp_path, {"batch_size": 4, "max_staleness": 8, "max_in_flight": 4})

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine(step_s=0.05)])
        try:
            return await run_loop(tmp_path, cfg, trainer, servers, prompts, 12)
        finally:
            await _stop(servers)

    loop = asyncio.run(main())
    busy = [m["rollout/busy_fraction"] for m in loop.metrics[2:]]
    assert np.mean(busy) >= 0.95, busy
    assert len(trained_ids(trainer)) == 48


def test_publishing_overlaps_the_next_train_step(tmp_path):
    prompts = items(100)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05, publish_s=0.4)
    cfg = config(tmp_path, {"batch_size": 2, "max_staleness": 2, "max_in_flight": 16})

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine(step_s=0.001)])
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(tmp_path, cfg, trainer, servers, prompts, 5, ledger=ledger)
        finally:
            ledger.close()
            await _stop(servers)

    loop = asyncio.run(main())
    # Step v+1 started while version v was still being written and delivered.
    starts = [start for start, _ in trainer.train_spans]
    overlapped = [v for v in range(1, 5) if v in trainer.published_at
                  and starts[v] < trainer.published_at[v]]
    assert overlapped, (starts, trainer.published_at)
    assert max(m["version/publish_lag"] for m in loop.metrics) >= 1
    # The gate counts from the version the servers serve, so no token is staler than the bound
    # measured from the weights that generated it: the last version is published at the end.
    assert loop.served_version == 5
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_invalid_requests_stop_the_run_with_the_servers_error(tmp_path):
    prompts = items(500)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    cfg = config(tmp_path, dataset={"path": "unused.jsonl", "reward": "no_such_reward"},
                 rollout={"max_consecutive_rejections": 5})

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine()])
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            with pytest.raises(RolloutRejectedError, match="reward_name"):
                await asyncio.wait_for(
                    run_loop(tmp_path, cfg, trainer, servers, prompts, 3, ledger=ledger), 30)
        finally:
            ledger.close()
            await _stop(servers)

    asyncio.run(main())
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    rejects = [line for line in lines if '"reject"' in line]
    # It stops after the limit instead of cycling through the dataset (in-flight ones aside).
    assert 5 <= len(rejects) <= 5 + 8, len(rejects)
    assert trainer.batches == []


def test_engine_failure_behind_a_live_server_loses_nothing(tmp_path):
    prompts = items(80)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    engines = [ArithmeticEngine(step_s=0.01), ArithmeticEngine(step_s=0.01)]

    async def kill_engine(loop, pool):
        while len(trainer.batches) < 1:
            await asyncio.sleep(0.01)
        engines[0].die("device lost")

    async def main():
        servers = await start_servers(tmp_path, engines)
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(tmp_path, config(tmp_path, {"max_staleness": 2}), trainer,
                                  servers, prompts, 6, ledger=ledger, during=kill_engine,
                                  options=PoolOptions(rejoin_interval_s=0.1))
        finally:
            ledger.close()
            await _stop(servers)

    loop = asyncio.run(main())
    assert len(loop.live_at_end) == 1  # the dead engine's server never rejoined
    assert loop.metrics[-1]["rollout/rejected_groups"] == 0
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_a_server_back_after_a_failure_rejoins_at_the_current_version(tmp_path):
    prompts = items(400)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.1)
    engines = [ArithmeticEngine(step_s=0.005), ArithmeticEngine(step_s=0.005)]
    replacement = ArithmeticEngine(step_s=0.005)
    rejoined = []

    async def main():
        servers = await start_servers(tmp_path, engines)

        async def bounce(loop, pool):
            while len(trainer.batches) < 1:
                await asyncio.sleep(0.01)
            port = servers[0].port
            await servers[0].stop(grace=0)
            while trainer.version < 3:
                await asyncio.sleep(0.01)
            back = await start_servers(tmp_path, [replacement], port=port)
            servers.extend(back)
            while not replacement.requests:
                await asyncio.sleep(0.01)
            rejoined.append(trainer.version)

        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(tmp_path, config(tmp_path, {"max_staleness": 2}), trainer,
                                  servers, prompts, 60, ledger=ledger, during=bounce,
                                  options=PoolOptions(rejoin_interval_s=0.1))
        finally:
            ledger.close()
            await _stop(servers[1:])

    loop = asyncio.run(main())
    assert rejoined and rejoined[0] < 60, "the restarted server never got work"
    assert len(loop.live_at_end) == 2
    # Brought to the trainer's published version before it got work, then served requests.
    first_load = replacement.loaded[0][1]
    assert first_load >= 3
    assert replacement.requests, "the rejoined server got no work"
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


class HangingUpdateEngine(ArithmeticEngine):
    async def update_weights(self, path, version):
        await asyncio.sleep(3600)


def test_a_server_hanging_on_update_does_not_stall_training(tmp_path):
    prompts = items(80)
    trainer = RecordingTrainer(exports_dir(tmp_path))

    async def main():
        servers = await start_servers(
            tmp_path, [HangingUpdateEngine(step_s=0.005), ArithmeticEngine(step_s=0.005)])
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            start = time.monotonic()
            loop = await run_loop(tmp_path, config(tmp_path, {"max_staleness": 2}), trainer,
                                  servers, prompts, 4, ledger=ledger,
                                  options=PoolOptions(update_timeout_s=0.5, rejoin_interval_s=60))
            return loop, time.monotonic() - start
        finally:
            ledger.close()
            await _stop(servers)

    loop, elapsed = asyncio.run(main())
    assert len(loop.live_at_end) == 1
    assert elapsed < 20
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


@pytest.mark.parametrize("policy", ["drop", "train"])
def test_overstale_groups_at_batch_formation(tmp_path, policy):
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    cfg = config(tmp_path, {"batch_size": 2, "max_staleness": 1, "max_in_flight": 6,
                            "overstale": policy})

    async def main():
        servers = await start_servers(
            tmp_path, [ArithmeticEngine(step_s=0.1), ArithmeticEngine(step_s=0.001)])
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(tmp_path, cfg, trainer, servers, prompts, 30, ledger=ledger)
        finally:
            ledger.close()
            await _stop(servers)

    loop = asyncio.run(main())
    worst = max(v - int(t.versions.min()) for v, groups in trainer.batches
                for g in groups for t in g.trajectories)
    over = max(m["staleness/over_bound_fraction"] for m in loop.metrics)
    if policy == "drop":
        assert worst <= 1
        assert over == 0
        assert loop.metrics[-1]["rollout/dropped_overstale"] > 0
    else:
        assert worst > 1 and over > 0  # trained anyway, and reported
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_a_restored_trainer_takes_servers_ahead_back_to_its_version(tmp_path):
    # Servers outlived a trainer that reached version 7; the trainer restarts from its
    # checkpoint at version 3, so tokens must never carry versions 4-7 of the discarded run.
    prompts = items(60)
    trainer = RecordingTrainer(exports_dir(tmp_path), version=3)
    engine = ArithmeticEngine(version=7)

    async def main():
        servers = await start_servers(tmp_path, [engine])
        path = write_checkpoint(exports_dir(tmp_path) / "v3", "v3")
        pool = RolloutPool([f"127.0.0.1:{servers[0].port}"])
        await pool.start()
        try:
            await sync_servers(pool, path, 3, config(tmp_path))
        finally:
            await pool.close()
        try:
            await run_loop(tmp_path, config(tmp_path), trainer, servers, prompts, 5)
        finally:
            await _stop(servers)

    asyncio.run(main())
    assert engine.loaded[0][1] == 3
    for version, groups in trainer.batches:
        for g in groups:
            for t in g.trajectories:
                assert int(t.versions.max()) <= version, (version, t.versions)
