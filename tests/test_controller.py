"""The asynchronous loop over real gRPC: staleness bound, nothing lost or doubled, server death,
resume. Two in-process rollout servers run the arithmetic engine double; the trainer is a
recording double whose versions advance like the real one's."""

import asyncio
import json

import numpy as np
import pytest
from _rollout_fakes import ArithmeticEngine, ExactAnswerScorer, encode, make_tokenizer_dir, write_checkpoint
from _rollout_harness import server_config

from areal_jax.controller.loop import RLLoop
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.data.dataset import PromptItem
from areal_jax.data.sampler import PromptIterator
from areal_jax.experiment import ExperimentConfig
from areal_jax.config import from_dict
from rollout.server import start_server


class RecordingTrainer:
    def __init__(self, tmp_path, version=0, train_s=0.05):
        self.version = version
        self.tmp_path = tmp_path
        self.train_s = train_s
        self.batches = []  # (version at training, groups)
        self.saved = []

    def train_on_batch(self, groups):
        import time

        time.sleep(self.train_s)
        self.batches.append((self.version, groups))
        self.version += 1
        return {"loss": 0.0}

    def publish(self, version):
        return str(write_checkpoint(self.tmp_path / f"v{version}", f"v{version}"))

    def save(self, state):
        self.saved.append((self.version, json.loads(json.dumps(state))))


def _items(n):
    rng = np.random.RandomState(0)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 50, size=2)
        out.append(PromptItem(id=f"p{i}", prompt_ids=encode(f"{a}+{b}="), prompt_text=f"{a}+{b}=",
                              metadata={"answer": str(a + b)}))
    return out


def _config(tmp_path, **schedule):
    return from_dict(ExperimentConfig, {
        "run_dir": str(tmp_path), "model_path": "tiny",
        "dataset": {"path": "unused.jsonl", "reward": "exact"},
        "sampling": {"group_size": 2, "max_new_tokens": 6},
        "schedule": {"batch_size": 3, "max_staleness": 1, "max_in_flight": 8, **schedule},
        "checkpoint_every": 2,
    })


async def _servers(tmp_path, count, step_s=0.002):
    tok = make_tokenizer_dir(tmp_path / "tok")
    servers = []
    for i in range(count):
        cfg = server_config(tmp_path / f"s{i}", tok)
        scorer = ExactAnswerScorer()
        servers.append(await start_server(cfg, engine=ArithmeticEngine(step_s=step_s),
                                          scorer=scorer, reward_names=scorer.names))
    return servers


def _trained_ids(trainer):
    return [g.group_id.split(":", 1)[1] for _, groups in trainer.batches for g in groups]


@pytest.mark.parametrize("mode,eta", [("async", 1), ("async", 0), ("sync", 0)])
def test_loop_respects_staleness_and_loses_nothing(tmp_path, mode, eta):
    async def main():
        servers = await _servers(tmp_path, 2)
        pool = RolloutPool([f"127.0.0.1:{s.port}" for s in servers])
        await pool.start()
        cfg = _config(tmp_path, mode=mode, max_staleness=eta)
        items = _items(40)
        trainer = RecordingTrainer(tmp_path)
        loop = RLLoop(cfg, trainer, pool, PromptIterator(items, seed=0),
                      {i.id: i for i in items}, on_step=lambda s, m: None)
        try:
            await loop.run(6, trainer.save)
        finally:
            await pool.close()
            for s in servers:
                await s.stop(grace=0.5)
        return trainer

    trainer = asyncio.run(main())
    assert len(trainer.batches) == 6
    for version, groups in trainer.batches:
        assert len(groups) == 3
        for g in groups:
            assert len(g.trajectories) == 2
            for t in g.trajectories:
                assert len(t.output_ids) > 0
                # Token staleness never exceeds the bound.
                assert version - int(t.versions.min()) <= eta, (version, t.versions)
    ids = _trained_ids(trainer)
    assert len(ids) == len(set(ids)) == 18
    # Checkpoints every 2 versions record the data position and the untrained groups.
    assert [v for v, _ in trainer.saved] == [2, 4, 6]


def test_dead_server_groups_are_resubmitted_elsewhere(tmp_path):
    async def main():
        servers = await _servers(tmp_path, 2, step_s=0.01)
        pool = RolloutPool([f"127.0.0.1:{s.port}" for s in servers])
        await pool.start()
        cfg = _config(tmp_path, max_staleness=2)
        items = _items(60)
        trainer = RecordingTrainer(tmp_path)
        loop = RLLoop(cfg, trainer, pool, PromptIterator(items, seed=0),
                      {i.id: i for i in items}, on_step=lambda s, m: None)

        async def kill_one():
            while len(trainer.batches) < 1:
                await asyncio.sleep(0.01)
            await servers[0].stop(grace=0)

        killer = asyncio.create_task(kill_one())
        try:
            await loop.run(5, trainer.save)
        finally:
            await killer
            live = pool.live_servers
            await pool.close()
            await servers[1].stop(grace=0.5)
        return trainer, live, loop

    trainer, live, loop = asyncio.run(main())
    assert len(live) == 1
    ids = _trained_ids(trainer)
    assert len(ids) == len(set(ids)) == 15
    assert loop.gate.submitted == loop.gate.in_flight + len(loop._buffer) + 15


def test_resume_resubmits_pending_groups_first(tmp_path):
    items = _items(30)
    cfg = _config(tmp_path, max_staleness=1)

    async def run(trainer, state, steps):
        servers = await _servers(tmp_path, 1)
        pool = RolloutPool([f"127.0.0.1:{servers[0].port}"])
        await pool.start()
        loop = RLLoop(cfg, trainer, pool, PromptIterator(items, seed=0),
                      {i.id: i for i in items}, on_step=lambda s, m: None)
        if state:
            loop.load_state_dict(state)
        try:
            await loop.run(steps, trainer.save)
        finally:
            await pool.close()
            await servers[0].stop(grace=0.5)
        return loop

    first = RecordingTrainer(tmp_path)
    asyncio.run(run(first, None, 2))
    version, state = first.saved[-1]
    assert version == 2 and state["pending"], state
    second = RecordingTrainer(tmp_path, version=2)
    asyncio.run(run(second, state, 6))
    resumed = _trained_ids(second)
    # Every group pending at the checkpoint is trained after the restart, nothing trained
    # before is trained again, and the data position carries on.
    assert set(state["pending"]) <= set(resumed)
    assert not set(resumed) & set(_trained_ids(first))
    assert len(set(resumed)) == len(resumed) == 12
