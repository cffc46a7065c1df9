"""Shared pieces of the controller tests: a recording trainer double, arithmetic prompts, an
experiment config, in-process rollout servers, and the ledger check that nothing was lost."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from _rollout_fakes import ArithmeticEngine, ExactAnswerScorer, encode, make_tokenizer_dir
from _rollout_fakes import write_checkpoint

from areal_jax.config import from_dict
from areal_jax.controller.ledger import RunLedger, read_ledger, rejected_prompts, trained_batches
from areal_jax.controller.loop import RLLoop
from areal_jax.controller.rollout_pool import PoolOptions, RolloutPool
from areal_jax.data.dataset import PromptItem
from areal_jax.data.sampler import PromptIterator
from areal_jax.experiment import ExperimentConfig
from rollout.config import ServerConfig
from rollout.server import start_server


@dataclasses.dataclass
class Snapshot:
    version: int
    write: object


class RecordingTrainer:
    """Advances versions like the real trainer; records batches, train and publish times."""

    def __init__(self, exports: Path, version: int = 0, train_s: float = 0.05,
                 publish_s: float = 0.0):
        self.version = version
        self.exports = Path(exports)
        self.train_s, self.publish_s = train_s, publish_s
        self.batches = []  # (version at training, groups)
        self.saved = []
        self.train_spans: list[tuple[float, float]] = []
        self.idle_spans: list[tuple[float, float]] = []  # the loop's waits for a batch
        self.published_at: dict[int, float] = {}

    def train_on_batch(self, groups):
        start = time.monotonic()
        time.sleep(self.train_s)
        self.batches.append((self.version, groups))
        self.version += 1
        self.train_spans.append((start, time.monotonic()))
        return {"loss": 0.0}

    @contextlib.contextmanager
    def idle(self):
        start = time.monotonic()
        try:
            yield
        finally:
            self.idle_spans.append((start, time.monotonic()))

    def snapshot_for_publish(self):
        version, path = self.version, self.exports / f"v{self.version}"

        def write():
            time.sleep(self.publish_s)
            out = str(write_checkpoint(path, f"v{version}"))
            self.published_at[version] = time.monotonic()
            return out

        return Snapshot(version, write)

    def save(self, state):
        self.saved.append((self.version, json.loads(json.dumps(state))))


def items(n: int) -> list[PromptItem]:
    rng = np.random.RandomState(0)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 50, size=2)
        out.append(PromptItem(id=f"p{i}", prompt_ids=encode(f"{a}+{b}="), prompt_text=f"{a}+{b}=",
                              metadata={"answer": str(a + b)}))
    return out


def config(tmp_path: Path, schedule: dict | None = None, **top) -> ExperimentConfig:
    data = {
        "run_dir": str(tmp_path), "model_path": "tiny",
        "dataset": {"path": "unused.jsonl", "reward": "exact"},
        "sampling": {"group_size": 2, "max_new_tokens": 6},
        "schedule": {"batch_size": 3, "max_staleness": 1, "max_in_flight": 8, **(schedule or {})},
        "checkpoint_every": 2,
    }
    for key, value in top.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(ExperimentConfig, data)


def exports_dir(tmp_path: Path) -> Path:
    """Where the recording trainer publishes; rollout servers may load from it."""
    return tmp_path / "exports"


async def start_servers(tmp_path: Path, engines: list[ArithmeticEngine],
                        scorer=ExactAnswerScorer, **overrides) -> list:
    """In-process rollout servers, one per engine (each with a ``scorer()``), all sharing the
    exports directory."""
    tok = make_tokenizer_dir(tmp_path / "tok")
    base = write_checkpoint(exports_dir(tmp_path) / "base", "base")
    servers = []
    for i, engine in enumerate(engines):
        cfg = from_dict(ServerConfig, {
            "engine": {"model_path": str(base), "tokenizer_path": str(tok)}, "port": 0,
            "push_dir": str(tmp_path / f"push{i}"), **overrides})
        instance = scorer()
        servers.append(await start_server(cfg, engine=engine, scorer=instance,
                                          reward_names=instance.names))
    return servers


def addresses(servers) -> list[str]:
    """Addresses of in-process servers (or the addresses themselves, for server processes)."""
    return [s if isinstance(s, str) else f"127.0.0.1:{s.port}" for s in servers]


async def run_loop(tmp_path: Path, cfg: ExperimentConfig, trainer: RecordingTrainer, servers,
                   prompts: list[PromptItem], steps: int, options: PoolOptions | None = None,
                   state: dict | None = None, ledger=None, during=None,
                   addresses_file: Path | None = None):
    """Run an ``RLLoop`` over ``servers`` (or those ``addresses_file`` lists) to ``steps``
    versions; ``during(loop, pool)`` runs alongside. Returns the loop (its pool closed)."""
    pool = RolloutPool([] if addresses_file else addresses(servers), options=options,
                       addresses_file=addresses_file)
    await pool.start()
    pool.record_weights(exports_dir(tmp_path) / "base", trainer.version)
    loop = RLLoop(cfg, trainer, pool, PromptIterator(prompts, seed=0),
                  {i.id: i for i in prompts}, on_step=lambda s, m: loop.metrics.append(m),
                  ledger=ledger)
    loop.metrics = []
    loop.task = asyncio.current_task()  # the one running the loop: ``during`` may cancel it
    if state:
        loop.load_state_dict(state)
    side = asyncio.create_task(during(loop, pool)) if during else None
    try:
        await loop.run(steps, trainer.save)
        loop.live_at_end = pool.live_servers
    finally:
        if side is not None:
            await side
        await pool.close()
    return loop


def trained_ids(trainer: RecordingTrainer) -> list[str]:
    return [g.group_id.split(":", 1)[1] for _, groups in trainer.batches for g in groups]


def assert_nothing_lost(ledger_path: Path, prompts, seed: int = 0, shuffle: bool = True) -> dict:
    """From the run's ledger: the prompts trained and rejected (as the run finally stands)
    plus those still pending at the end are exactly those the data iterator yielded: nothing
    lost, nothing trained or rejected twice. Returns the trained batches."""
    events = read_ledger(ledger_path)
    end = [e for e in events if e["event"] == "end"][-1]
    batches = trained_batches(events)
    assert sorted(batches) == list(range(1, end["version"] + 1)), sorted(batches)
    trained = [p for ids in batches.values() for p in ids]
    rejected = rejected_prompts(events)
    data = end["data"]
    iterator = PromptIterator(prompts, seed=seed, shuffle=shuffle)
    yielded = [next(iterator).id for _ in range(data["epoch"] * data["size"] + data["index"])]
    got = (collections.Counter(trained) + collections.Counter(end["pending"])
           + collections.Counter(rejected))
    want = collections.Counter(yielded)
    assert got == want, (got - want, want - got)
    return batches


def run_on_servers(tmp_path: Path, engines: list[ArithmeticEngine], cfg: ExperimentConfig,
                   trainer: RecordingTrainer, prompts: list[PromptItem], steps: int,
                   during=None, options: PoolOptions | None = None, state: dict | None = None,
                   scorer=ExactAnswerScorer):
    """``run_loop`` over in-process servers for ``engines``, with the run ledger at
    ``tmp_path/ledger.jsonl``; ``during(loop, pool, servers)`` runs alongside. The servers
    (including any ``during`` appends to the list) are stopped at the end."""

    async def main():
        servers = await start_servers(tmp_path, engines, scorer)
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        side = (lambda loop, pool: during(loop, pool, servers)) if during else None
        try:
            return await run_loop(tmp_path, cfg, trainer, servers, prompts, steps,
                                  options=options, state=state, ledger=ledger, during=side)
        finally:
            ledger.close()
            for s in servers:
                await s.stop(grace=0.5)

    return asyncio.run(main())
