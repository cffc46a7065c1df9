"""The loop as an asynchronous system, over real gRPC with in-process servers: generation never
waits for the trainer, publishing overlaps training, failed servers lose nothing and may rejoin,
invalid requests stop the run, over-stale groups are dropped on request, and a restarted
trainer takes servers that are ahead back to its version."""

import asyncio
import contextlib
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _loop_kit import RecordingTrainer, assert_nothing_lost, config, exports_dir, items, run_loop
from _loop_kit import addresses, run_on_servers, start_servers, trained_ids
from _rollout_fakes import ID_TO_CHAR, VOCAB, ArithmeticEngine, FailingScorer, encode
from _rollout_fakes import write_checkpoint

from areal_jax.controller.ledger import read_ledger
from areal_jax.controller.loop import RolloutRejectedError
from areal_jax.controller.reward_watch import RewardFailingError
from areal_jax.controller.requests import rollout_request
from areal_jax.controller.rollout_pool import PoolOptions, RequestFailedError, RolloutPool
from areal_jax.controller.rollout_pool import WeightsRejectedError
from areal_jax.controller.servers import sync_servers
from areal_jax.trajectory import Trajectory
from rollout.engine import EngineError, GenerationChunk, WeightLoadError


def test_generation_never_waits_for_the_trainer(tmp_path):
    # Where generation is the bottleneck and the in-flight cap binds, not the staleness gate:
    # every slot freed while the trainer trains or publishes must be refilled at once (with
    # the refill at the top of the loop only, this measured 0.61).
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.1, publish_s=0.1)
    cfg = config(tmp_path, {"batch_size": 4, "max_staleness": 8, "max_in_flight": 4})
    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.05)], cfg, trainer, prompts, 12)
    busy = [m["rollout/busy_fraction"] for m in loop.metrics[2:]]
    assert np.mean(busy) >= 0.95, busy
    assert len(trained_ids(trainer)) == 48


def test_at_the_quickstarts_settings_generation_runs_up_to_the_staleness_bound(tmp_path):
    # The quickstart's operating point on a 2-core CPU (batch 8, bound 2, in-flight cap 16):
    # the trainer is the slower side and the staleness gate binds. At every step's end the
    # groups generating or generated and not yet trained are all the gate allows: the servers'
    # version lags the trainer's by the publish in flight, so bound x batch, never fewer
    # (generation waited) and never more (the gate let one group too many through).
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.15, publish_s=0.02)
    cfg = config(tmp_path, {"batch_size": 8, "max_staleness": 2, "max_in_flight": 16})
    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.001)], cfg, trainer, prompts, 10)
    ahead = [m["rollout/in_flight"] + m["rollout/buffered"] for m in loop.metrics[1:]]
    assert ahead == [16.0] * 9, ahead
    assert max(m["staleness/over_bound_fraction"] for m in loop.metrics) == 0
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_publishing_overlaps_the_next_train_step(tmp_path):
    prompts = items(100)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05, publish_s=0.4)
    cfg = config(tmp_path, {"batch_size": 2, "max_staleness": 2, "max_in_flight": 16})
    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.001)], cfg, trainer, prompts, 5)
    # Step v+1 started while version v was still being written and delivered.
    starts = [start for start, _ in trainer.train_spans]
    overlapped = [v for v in range(1, 5) if v in trainer.published_at
                  and starts[v] < trainer.published_at[v]]
    assert overlapped, (starts, trainer.published_at)
    assert max(m["version/publish_lag"] for m in loop.metrics) >= 1
    # The last version is delivered before the loop returns.
    assert loop.served_version == 5
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_invalid_requests_stop_the_run_with_the_servers_error(tmp_path):
    trainer = RecordingTrainer(exports_dir(tmp_path))
    cfg = config(tmp_path, dataset={"path": "unused.jsonl", "reward": "no_such_reward"},
                 rollout={"max_consecutive_rejections": 5})
    start = time.monotonic()
    with pytest.raises(RolloutRejectedError, match="reward_name"):
        run_on_servers(tmp_path, [ArithmeticEngine()], cfg, trainer, items(500), 3)
    assert time.monotonic() - start < 30
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    rejects = [line for line in lines if '"reject"' in line]
    # It stops after the limit instead of cycling through the dataset (in-flight ones aside).
    assert 5 <= len(rejects) <= 5 + 8, len(rejects)
    assert trainer.batches == []


def test_a_reward_failing_in_every_call_stops_the_run(tmp_path, caplog):
    # Each failed call scores 0: a run would train on nothing but zeros, with the errors only
    # in the servers' logs. Three batches in a row of failures stop it, naming the error.
    trainer = RecordingTrainer(exports_dir(tmp_path))
    with pytest.raises(RewardFailingError, match=r"reward 'exact' failed in every call of 3 "
                                                 r"batches in a row.*KeyError: 'no_such_key'"):
        run_on_servers(tmp_path, [ArithmeticEngine()], config(tmp_path), trainer, items(100),
                       10, scorer=FailingScorer)
    assert len(trainer.batches) == 2  # the third is not trained
    warnings = [r for r in caplog.records if "failed in" in r.getMessage()]
    assert len(warnings) == 1 and "KeyError" in warnings[0].getMessage()  # once per message


def hanging_reward(completion: str, metadata: dict) -> float:
    time.sleep(600)
    return 1.0


def test_a_reward_that_hangs_stops_the_run_after_a_few_timeouts(tmp_path):
    # A real reward pool with one worker, its reward hanging on every call: without probing,
    # each of the three failing batches' 6 calls (and the in-flight ones) waits its timeout
    # in turn; with it, once 4 calls in a row timed out, one call at a time runs.
    from areal_jax.rewards import RewardPool

    pools = []

    def scorer():
        pool = RewardPool(num_workers=1, timeout_s=0.3, timeouts_to_probe=4,
                          custom={"exact": f"{__name__}:hanging_reward"})
        pool.names = pool.reward_names
        pools.append(pool)
        return pool

    trainer = RecordingTrainer(exports_dir(tmp_path))
    try:
        with pytest.raises(RewardFailingError, match="failed in every call of 3 batches"):
            run_on_servers(tmp_path, [ArithmeticEngine()], config(tmp_path), trainer, items(100),
                           10, scorer=scorer)
        (pool,) = pools
        assert pool.num_timeouts <= 4 + 5 and pool.num_skipped >= 10, (
            pool.num_timeouts, pool.num_skipped)
    finally:
        for pool in pools:
            pool.close()
    assert len(trainer.batches) == 2


def test_a_workflow_whose_extra_reward_calls_fail_is_not_stopped():
    # A workflow scoring a draft and a final answer, the draft's call failing: every answer
    # still has a reward. Failures are counted against calls, not answers.
    from areal_jax.controller.reward_watch import RewardWatch
    from areal_jax.trajectory import TrajectoryGroup

    def batch(calls, failures):
        meta = {"reward_calls": calls, "reward_failures": failures, "reward_error": "draft: boom"}
        return [TrajectoryGroup(f"g{i}", _scored(0.0, 1.0), dict(meta)) for i in range(3)]

    watch = RewardWatch("r")
    for _ in range(5):
        assert watch.observe(batch(calls=4, failures=2))["reward/failed_fraction"] == 0.5
    for _ in range(2):
        watch.observe(batch(calls=4, failures=4))
    with pytest.raises(RewardFailingError, match="failed in every call of 3 batches"):
        watch.observe(batch(calls=4, failures=4))


def _scored(*rewards):
    return [Trajectory([1], [2], np.zeros(1), np.zeros(1), reward=r) for r in rewards]


def test_batches_without_a_learning_signal_are_counted_and_a_run_of_them_is_reported(caplog):
    """A reward that scores every sample alike (always 0: a prompt format it cannot read)
    trains on zero advantages: said after three such batches in a row, at most three times."""
    from areal_jax.controller.reward_watch import RewardWatch
    from areal_jax.trajectory import TrajectoryGroup

    def batch(*groups):
        return [TrajectoryGroup(f"g{i}", _scored(*rewards)) for i, rewards in enumerate(groups)]

    watch = RewardWatch("mine")
    assert watch.observe(batch((0.0, 0.0), (1.0, 0.0)))["reward/flat_groups"] == 0.5
    for _ in range(2):
        assert watch.observe(batch((0.0, 0.0), (1.0, 1.0)))["reward/flat_groups"] == 1.0
    assert "no learning signal" not in caplog.text
    watch.observe(batch((0.0, 0.0), (0.0, 0.0)))
    warnings = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(warnings) == 1 and "last 3 batches" in warnings[0]
    assert "(seen: 0)" in warnings[0] and "reward 'mine'" in warnings[0]
    for _ in range(30):  # one long run of them: one warning; later runs: two more at most
        watch.observe(batch((0.0, 0.0)))
    for _ in range(5):
        watch.observe(batch((0.0, 1.0)))
        for _ in range(3):
            watch.observe(batch((0.0, 0.0)))
    assert sum("no learning signal" in r.getMessage() for r in caplog.records) == 3
    # The run's estimator decides: REINFORCE's batch-mean baseline learns from rewards that
    # differ between groups (groups of one included), GRPO from none of groups of one.
    from areal_jax.rl import AdvantageConfig

    caplog.clear()
    reinforce = RewardWatch("mine", advantage=AdvantageConfig(estimator="reinforce"))
    grpo = RewardWatch("mine")
    for _ in range(5):
        assert reinforce.observe(batch((0.0,), (1.0,)))["reward/flat_groups"] == 1.0
        grpo.observe(batch((0.0,), (1.0,)))
    warned = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(warned) == 1 and "under the grpo estimator" in warned[0]
    shaped = RewardWatch("mine", advantage=AdvantageConfig(overlong_window=4))
    for _ in range(5):  # an overlong penalty gives alike rewards a signal: not called flat
        shaped.observe(batch((0.0, 0.0)))
    assert len([r for r in caplog.records if "no learning signal" in r.getMessage()]) == 1


def test_reward_failures_are_counted_per_batch(tmp_path):
    trainer = RecordingTrainer(exports_dir(tmp_path))
    prompts = items(60)
    odd = lambda answer: int(answer) % 2 == 1  # noqa: E731
    loop = run_on_servers(tmp_path, [ArithmeticEngine()], config(tmp_path), trainer, prompts, 6,
                          scorer=lambda: FailingScorer(odd))
    assert len(trainer.batches) == 6  # some answers scored: the run goes on
    answer = {p.id: p.metadata["answer"] for p in prompts}
    seen = set()
    for (_, groups), metrics in zip(trainer.batches, loop.metrics):
        failing = sum(len(g.trajectories) for g in groups
                      if odd(answer[g.group_id.split(":", 1)[1]]))
        assert metrics["reward/failed_calls"] == failing
        assert metrics["reward/failed_fraction"] == failing / 6  # one call per answer
        seen.add(failing)
    assert len(seen) > 1  # batches with more and fewer failures: the count is per batch


def test_no_prompt_is_submitted_once_the_loop_has_ended(tmp_path):
    """With room under the gate at the last version, each group finishing after the loop
    ended (during the evaluation after RL) submitted another training prompt that was never
    trained: the ledger showed submits after its end, missing from its pending list."""
    trainer = RecordingTrainer(exports_dir(tmp_path))
    prompts = items(80)
    # generation the slow side, the in-flight cap binding, the gate far from full
    cfg = config(tmp_path, {"max_staleness": 20, "max_in_flight": 4})

    async def linger(loop, pool, servers):  # as the evaluation after RL: the pool still open
        while trainer.version < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)

    run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.02)], cfg, trainer, prompts, 3,
                   during=linger)
    events = read_ledger(tmp_path / "ledger.jsonl")
    end = max(i for i, e in enumerate(events) if e["event"] == "end")
    assert [e for e in events[end + 1:] if e["event"] == "submit"] == []
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


@pytest.mark.parametrize("every_steps", [0, 2])
def test_groups_in_flight_when_the_loop_ends_are_withdrawn_and_stay_pending(tmp_path,
                                                                           every_steps):
    """The groups still generating at the last version went on taking the servers' slots
    during the evaluation after RL (the loop's own, where eval.every_steps divides the steps;
    each group finishing then even asked for another), though nothing would train them."""
    from _rollout_fakes import until

    trainer = RecordingTrainer(exports_dir(tmp_path))
    prompts = items(80)
    cfg = config(tmp_path, {"max_staleness": 20, "max_in_flight": 4},
                 eval={"every_steps": every_steps})
    engine = ArithmeticEngine(step_s=0.5)  # a group takes at least 1.5 s
    seen = {}

    async def evaluation_after_rl(loop, servers):
        seen["ended"], submitted = loop._ended, loop.gate.submitted
        seen["withdrawn"] = len(loop.pending_ids()) - len(loop._buffer)
        await until(lambda: servers[0].servicer.held == 0, timeout_s=1.0)  # before any finished
        seen["active"], seen["asked"] = engine.active, loop.gate.submitted - submitted

    async def hook(loop, pool, servers):
        if every_steps:
            async def on_eval(version):
                if version == 2:
                    await evaluation_after_rl(loop, servers)
                return {}

            loop.on_eval = on_eval
            return
        while not loop._ended:
            await asyncio.sleep(0.005)
        await evaluation_after_rl(loop, servers)

    loop = run_on_servers(tmp_path, [engine], cfg, trainer, prompts, 2, during=hook)
    assert seen == {"ended": True, "withdrawn": 4, "active": 0, "asked": 0}
    assert loop.gate.in_flight == 0
    pending = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "end"][-1][
        "pending"]
    assert len(pending) == 4 + len(loop._buffer)
    assert trainer.saved[-1][1]["pending"] == pending  # the last checkpoint keeps them too
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_an_evaluation_in_the_loop_runs_beside_training_on_the_version_it_evaluates(tmp_path):
    """The loop waited for each evaluation (eval.every_steps) before its next step: a full batch
    was ready, so the gate filled and the servers generated nothing for the trainer (19% of a
    two-server quickstart's RL phase). Now the trainer trains on while the servers keep the
    evaluated version (publishing held, the staleness bound kept), and the evaluation's row is
    logged when it ends."""
    from _rollout_fakes import until

    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    prompts = items(200)
    cfg = config(tmp_path, {"max_staleness": 2, "max_in_flight": 6}, eval={"every_steps": 2})
    during_evaluation, logged = {}, []

    async def hook(loop, pool, servers):
        async def on_eval(version):
            served = [loop.served_version]

            def next_evaluations_version() -> bool:
                served.append(loop.served_version)
                return trainer.version == 4

            if version == 2:  # until the trainer reaches the version of the next evaluation
                with contextlib.suppress(AssertionError):  # (it never did: it waited for this)
                    await until(next_evaluations_version, timeout_s=10)
            for _ in range(10):  # more time, for a version trained beyond it to show
                await asyncio.sleep(0.02)
                served.append(loop.served_version)
            during_evaluation[version] = (trainer.version, set(served))
            return {"eval/accuracy": version / 10}

        loop.on_eval = on_eval
        loop.on_evaluated = lambda v, m: logged.append((v, m["eval/accuracy"]))

    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.002)], cfg, trainer, prompts, 6,
                          during=hook)
    assert logged == [(2, 0.2), (4, 0.4), (6, 0.6)]  # each logged, the last before the end
    trained, served = during_evaluation[2]
    assert served == {2}  # nothing newer published while version 2 was evaluated
    # The trainer went on to the gate's bound: (2 + 2 + 1) x 3 groups generated at version 2
    # at most, 5 batches; waiting at version 4 for this evaluation before starting the next.
    assert trained == 4
    assert during_evaluation[6] == (6, {6})
    assert max(m["staleness/over_bound_fraction"] for m in loop.metrics) == 0
    assert max(trainer.published_at) == 6
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


@pytest.mark.parametrize("ending", ["stopped", "failed"])
def test_an_evaluation_beside_training_ends_with_the_run(tmp_path, ending):
    """A stop during an in-loop evaluation cancels it (no row) and checkpoints what was trained;
    an evaluation that fails stops the run with its error. Neither is left running."""
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    prompts = items(200)
    cfg = config(tmp_path, {"max_staleness": 2}, eval={"every_steps": 2})
    states = []

    async def hook(loop, pool, servers):
        async def on_eval(version):
            states.append("started")
            try:
                await asyncio.sleep(0.3)
                if ending == "failed":
                    raise RuntimeError("the evaluation broke")
                loop.task.cancel()
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                states.append("cancelled")
                raise

        loop.on_eval = on_eval
        loop.on_evaluated = lambda v, m: states.append("logged")

    expected = asyncio.CancelledError if ending == "stopped" else RuntimeError
    with pytest.raises(expected):
        run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.002)], cfg, trainer, prompts, 6,
                       during=hook)
    assert states == (["started", "cancelled"] if ending == "stopped" else ["started"])
    if ending == "stopped":
        assert trainer.saved[-1][0] == trainer.version  # the stop's checkpoint
    version, state = trainer.saved[-1]
    resumed = RecordingTrainer(exports_dir(tmp_path), version=version)
    run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.002)], config(tmp_path, {
        "max_staleness": 2}), resumed, prompts, 6, state=state)
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_engine_failure_behind_a_live_server_loses_nothing(tmp_path):
    prompts = items(80)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    engines = [ArithmeticEngine(step_s=0.01), ArithmeticEngine(step_s=0.01)]

    async def kill_engine(loop, pool, servers):
        while len(trainer.batches) < 1:
            await asyncio.sleep(0.01)
        engines[0].die("device lost")

    loop = run_on_servers(tmp_path, engines, config(tmp_path, {"max_staleness": 2}), trainer,
                          prompts, 6, during=kill_engine,
                          options=PoolOptions(rejoin_interval_s=0.1))
    assert len(loop.live_at_end) == 1  # the dead engine's server never rejoined
    assert loop.metrics[-1]["rollout/rejected_groups"] == 0
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_a_server_back_after_a_failure_rejoins_at_the_current_version(tmp_path):
    prompts = items(400)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.1)
    replacement = ArithmeticEngine(step_s=0.005)
    rejoined = []

    async def bounce(loop, pool, servers):
        while len(trainer.batches) < 1:
            await asyncio.sleep(0.01)
        port = servers[0].port
        await servers[0].stop(grace=0)
        while trainer.version < 3:
            await asyncio.sleep(0.01)
        servers.extend(await start_servers(tmp_path, [replacement], port=port))
        while not replacement.requests:
            await asyncio.sleep(0.01)
        rejoined.append(trainer.version)

    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.005) for _ in range(2)],
                          config(tmp_path, {"max_staleness": 2}), trainer, prompts, 60,
                          during=bounce,
                          options=PoolOptions(rejoin_interval_s=0.1, update_timeout_s=3))
    assert rejoined and rejoined[0] < 60, "the restarted server never got work"
    assert len(loop.live_at_end) == 2
    # Brought to the trainer's published version before it got work.
    assert replacement.loaded[0][1] >= 3
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


class HangingUpdateEngine(ArithmeticEngine):
    async def update_weights(self, path, version):
        await asyncio.sleep(3600)


def test_a_server_hanging_on_update_does_not_stall_training(tmp_path):
    prompts = items(80)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    start = time.monotonic()
    loop = run_on_servers(tmp_path, [HangingUpdateEngine(step_s=0.005),
                                     ArithmeticEngine(step_s=0.005)],
                          config(tmp_path, {"max_staleness": 2}), trainer, prompts, 4,
                          options=PoolOptions(update_timeout_s=0.5, rejoin_interval_s=60))
    assert len(loop.live_at_end) == 1
    assert time.monotonic() - start < 20
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


def test_a_server_that_takes_groups_and_never_answers_leaves_the_pool(tmp_path, caplog):
    # Its process alive (pings, health and status answered), it held its groups for good: with
    # another server half the in-flight cap stayed there, with it alone the run waited forever
    # without a word.
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.1)
    stuck = ArithmeticEngine(step_s=10_000)
    start = time.monotonic()
    run_on_servers(tmp_path, [stuck, ArithmeticEngine(step_s=0.005)],
                   config(tmp_path, {"max_staleness": 2}), trainer, prompts, 40,
                   options=PoolOptions(stall_timeout_s=1.0, rejoin_interval_s=0.2))
    assert time.monotonic() - start < 30
    assert stuck.requests and trainer.version == 40
    assert "no group back and no token generated for 1 s" in caplog.text
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    # Alone, its groups come back as failed after their attempts: the run stops, saying why.
    trainer = RecordingTrainer(exports_dir(tmp_path / "alone"))
    start = time.monotonic()
    with pytest.raises(RequestFailedError, match=r"failed 2 times .*no group back and no token "
                                                 r"generated for 0.5 s with \d+ groups in flight "
                                                 r"\(rollout.stall_timeout_s\)"):
        run_on_servers(tmp_path / "alone", [ArithmeticEngine(step_s=10_000)],
                       config(tmp_path / "alone"), trainer, prompts, 4,
                       options=PoolOptions(stall_timeout_s=0.5, rejoin_interval_s=0.1,
                                           max_attempts=2))
    assert time.monotonic() - start < 30


class WholeSequenceEngine(ArithmeticEngine):
    """Like SGLang's adapter: a sequence's tokens come in one chunk when it ends (here after
    ``sequence_s``), so the token count does not move while it generates."""

    tokens_as_generated = False

    def __init__(self, sequence_s: float):
        super().__init__()
        self.sequence_s = sequence_s

    async def generate(self, prompt_ids, params, request_id):
        await asyncio.sleep(self.sequence_s)
        chunks = [c async for c in super().generate(prompt_ids, params, request_id)]
        yield GenerationChunk(tuple(t for c in chunks for t in c.token_ids),
                              tuple(p for c in chunks for p in c.logprobs),
                              tuple(v for c in chunks for v in c.versions), chunks[-1].finish_reason)


def test_a_server_whose_tokens_come_as_sequences_end_is_not_taken_for_stalled(tmp_path, caplog):
    # Its token count stays put while long sequences generate: read as a stall, a healthy
    # SGLang server lost its groups and was taken out of the pool, again after each rejoin.
    async def main():
        servers = await start_servers(tmp_path, [WholeSequenceEngine(sequence_s=2.5)])
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            stall_timeout_s=0.5, rejoin_interval_s=0.1))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        try:
            futures = [pool.submit(rollout_request(item, f"0:{item.id}", "exact", 2, 6, 1.0,
                                                   seed=0)) for item in items(4)]
            return await asyncio.wait_for(asyncio.gather(*futures), 30)
        finally:
            await pool.close()
            await asyncio.gather(*(s.stop(grace=0) for s in servers))

    groups = asyncio.run(main())
    assert all(not g.HasField("error") for g in groups)
    assert "left the pool" not in caplog.text


class CrashingEngine(ArithmeticEngine):
    """Fails every request with an error of its own (the server answers INTERNAL)."""

    def generate(self, prompt_ids, params, request_id):
        self.requests.append((request_id, list(prompt_ids), params))
        raise RuntimeError("a defect of this server")


def _twenty_versions_beside(broken: ArithmeticEngine, tmp_path):
    """Train 20 versions on ``broken`` and a sound server (3 attempts per request); the
    trainer, which reached version 20, and the prompts."""
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    run_on_servers(tmp_path, [broken, ArithmeticEngine(step_s=0.005)],
                   config(tmp_path, {"max_staleness": 2}), trainer, prompts, 20,
                   options=PoolOptions(rejoin_interval_s=0.1, max_attempts=3))
    assert trainer.version == 20
    return trainer, prompts


def test_a_server_failing_every_group_leaves_the_pool_and_is_logged_once(tmp_path, caplog):
    # Answering at once, it had the fewest groups in flight and got most new ones: 330 of
    # them over 20 versions, each a warning here and a traceback there, for the whole run.
    broken = CrashingEngine()
    trainer, prompts = _twenty_versions_beside(broken, tmp_path)
    groups = len({rid for rid, _, _ in broken.requests})
    # three strikes, each after three faults, with at most the in-flight cap (8) beside them
    assert groups <= 3 * (3 + 8), groups
    warned = caplog.text.count("sending it again")
    assert 1 <= warned <= 3, warned
    assert "was taken out of the pool 3 times in a row" in caplog.text
    assert "it stays out of the pool until it is restarted" in caplog.text
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


class OutOfVocabularyEngine(ArithmeticEngine):
    """Answers with a token id past its vocabulary first (a defect, another model's ids)."""

    def answer(self, context, params, request_id):
        return [self.vocab_size + 7] + super().answer(context, params, request_id)


def test_a_server_sending_malformed_groups_is_taken_out_and_none_of_them_is_trained(
        tmp_path, caplog):
    # Its groups were trained as they came (a gather clamps the bad id: silently corrupted
    # training), and one with mismatched lengths stopped the run with a traceback.
    broken = OutOfVocabularyEngine()
    trainer, prompts = _twenty_versions_beside(broken, tmp_path)
    vocab = broken.vocab_size
    assert all(int(t.output_ids.max()) < vocab for _, groups in trainer.batches
               for g in groups for t in g.trajectories)
    assert broken.requests  # it was sent work, and all of it went elsewhere
    assert (f"the group it sent back is malformed: trajectories[0].output_ids: {vocab + 7} is "
            f"not a token id of a vocabulary of {vocab}") in caplog.text
    assert "was taken out of the pool 3 times in a row" in caplog.text
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)



class RamblingEngine(ArithmeticEngine):
    """Answers prompts whose first number is a multiple of ``every`` with ``max_new_tokens`` of
    filler (``every`` 1: all of them), the others as usual."""

    def __init__(self, every: int, **kwargs):
        super().__init__(**kwargs)
        self.every = every

    def answer(self, context, params, request_id):
        first = "".join(ID_TO_CHAR.get(t, "") for t in context).split("+")[0]
        if int(first) % self.every == 0:
            return [VOCAB["?"]] * params.max_new_tokens
        return super().answer(context, params, request_id)


def test_answers_too_long_to_train_on_are_rejected_not_a_crash(tmp_path, caplog):
    # A trajectory over the micro-batch token budget (a multi-turn workflow's) failed the
    # train step mid-run with a traceback, after the work before it.
    prompts = items(200)
    cfg = config(tmp_path, {"max_staleness": 2}, trainer={"micro_batch": {"token_budget": 9}})
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.01)
    run_on_servers(tmp_path, [RamblingEngine(every=4)], cfg, trainer, prompts, 10)
    assert trainer.version == 10
    assert max(len(t.prompt_ids) + len(t.output_ids) for _, groups in trainer.batches
               for g in groups for t in g.trajectories) <= 9
    assert "over trainer.micro_batch.token_budget (9)" in caplog.text
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    # Each rejection was a warning: a workflow whose answers often run long flooded the
    # console. The first five are shown, the rest counted (here at the loop's end).
    rejected = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "reject"]
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) > 5 and sum(" rejected: " in line for line in lines) == 5
    assert lines[5:] == [f"{len(rejected) - 5} more rejected prompts (field trajectories: a "
                         "trajectory of N tokens (prompt and answer) is over "
                         "trainer.micro_batch.token_budget (N): the workflow's answers must fit "
                         "one micro-batch; raise the budget or bound the answers) "
                         f"({len(rejected)} in all)"]

    with pytest.raises(RolloutRejectedError, match=r"\d+ groups in a row were rejected, by the "
                       r"rollout servers or as too long to train on .* the last one: "
                       r"trajectories: a trajectory of 1\d "
                       r"tokens \(prompt and answer\) is over trainer.micro_batch.token_budget"):
        run_on_servers(tmp_path / "all", [RamblingEngine(every=1)],
                       config(tmp_path / "all", {"max_staleness": 2},
                              trainer={"micro_batch": {"token_budget": 9}},
                              rollout={"max_consecutive_rejections": 3}),
                       RecordingTrainer(exports_dir(tmp_path / "all")), prompts, 10)


def test_rejections_after_the_checkpoint_a_run_resumes_from_are_void_in_the_ledger(tmp_path):
    # The ledger kept a killed run's rejections past its last checkpoint: their prompts were
    # generated again by the resumed run, and the ledger showed them rejected and trained, or
    # rejected twice, where nothing had been lost.
    prompts = items(200)
    cfg = config(tmp_path, {"max_staleness": 2}, trainer={"micro_batch": {"token_budget": 9}},
                 checkpoint_every=2)
    first = RecordingTrainer(exports_dir(tmp_path), train_s=0.01)
    run_on_servers(tmp_path, [RamblingEngine(every=4)], cfg, first, prompts, 6)
    (version, state), = [(v, st) for v, st in first.saved if v == 4]
    # Killed after version 6 was trained, before its checkpoint was written: the run resumes
    # from version 4, where fewer groups had been rejected than by the end.
    rejected = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "reject"]
    assert len(rejected) > state["rejected_groups"] > 0
    # Generated again, those answers come out short enough (sampling) and are trained.
    resumed = RecordingTrainer(exports_dir(tmp_path), version=4, train_s=0.01)
    run_on_servers(tmp_path, [ArithmeticEngine()], cfg, resumed, prompts, 8, state=state)
    starts = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e["event"] == "start"]
    assert [(e["version"], e["rejected"]) for e in starts] == [
        (0, 0), (4, state["rejected_groups"])]
    batches = assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    assert sorted(batches) == list(range(1, 9))


@pytest.mark.parametrize("policy", ["drop", "train"])
def test_overstale_groups_at_batch_formation(tmp_path, policy):
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    cfg = config(tmp_path, {"batch_size": 2, "max_staleness": 1, "max_in_flight": 6,
                            "overstale": policy})
    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.1), ArithmeticEngine(step_s=0.001)],
                          cfg, trainer, prompts, 30)
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


def test_a_request_that_takes_down_every_server_it_reaches_stops_the_run(tmp_path):
    # The engine fails on one prompt (UNAVAILABLE: the server looks like it is going away), the
    # server answers SERVING again and rejoins: without a count the request cycled forever.
    prompts = items(30)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    engines = [ArithmeticEngine(fail_on=prompts[3].prompt_text) for _ in range(2)]
    options = PoolOptions(max_attempts=3, rejoin_interval_s=0.1)
    start = time.monotonic()
    with pytest.raises(RequestFailedError, match=r"failed 3 times .*UNAVAILABLE: engine: backend"):
        run_on_servers(tmp_path, engines, config(tmp_path), trainer, prompts, 20, options=options)
    assert time.monotonic() - start < 30
    poison = encode(prompts[3].prompt_text)
    sends = sum(prompt == poison for e in engines for _, prompt, _ in e.requests)
    assert 3 <= sends <= 3 * 2, sends  # three sends of a group of two samples


def test_a_request_that_breaks_every_stream_it_reaches_fails_after_its_attempts(tmp_path):
    # A request over the servers' message limit (within the pool's) ended the stream it went
    # on, with no reply to charge: it moved from server to server for ever, each time taking
    # every other group on that server with it, and the run stalled with no error.
    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine(), ArithmeticEngine()],
                                      max_message_mb=1)
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            max_message_mb=4, max_attempts=3, rejoin_interval_s=0.1))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        good, bad, huge = items(3)
        bad.metadata["blob"] = "x" * (2 << 20)
        huge.metadata["blob"] = "x" * (5 << 20)
        try:
            poison = pool.submit(rollout_request(bad, "0:bad", "exact", 2, 6, 1.0, seed=0))
            with pytest.raises(RequestFailedError, match=r"failed 3 times .*stream failed"):
                await asyncio.wait_for(poison, 30)
            while len(pool.live_servers) < 2:
                await asyncio.sleep(0.05)
            ok = await asyncio.wait_for(
                pool.submit(rollout_request(good, "1:good", "exact", 2, 6, 1.0, seed=0)), 30)
            # Over the pool's own limit: refused before it is sent, as the request's error.
            refused = await pool.submit(rollout_request(huge, "2:huge", "exact", 2, 6, 1.0))
            return ok, refused
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    ok, refused = asyncio.run(main())
    assert not ok.HasField("error") and len(ok.trajectories) == 2
    assert (refused.error.code, refused.error.field) == (3, "request")  # INVALID_ARGUMENT
    assert "over max_message_mb (4 MiB)" in refused.error.message


class _RefusesOneLoad(ArithmeticEngine):
    """Refuses its first load of version 2 (a short read, say); takes every other."""

    refused = False

    async def update_weights(self, path: str, version: int) -> None:
        if version == 2 and not self.refused:
            self.refused = True
            raise WeightLoadError("short read of model.safetensors")
        await super().update_weights(path, version)


def test_a_server_refusing_an_update_the_others_took_leaves_and_rejoins(tmp_path):
    # One server's refusal ended the run (WeightsRejectedError) though the other had loaded
    # the version; only an update every server refuses is the export's fault.
    prompts = items(200)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    flaky = _RefusesOneLoad(step_s=0.01)

    async def rejoined(loop, pool, servers):
        while not (flaky.refused and len(pool.live_servers) == 2):
            await asyncio.sleep(0.01)

    run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.01), flaky], config(tmp_path), trainer,
                   prompts, 8, during=rejoined, options=PoolOptions(rejoin_interval_s=0.1))
    assert trainer.version == 8 and flaky.refused and flaky.version >= 2
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)

    # Every server refusing is the export's fault: the error is raised.
    async def all_refuse():
        servers = await start_servers(tmp_path / "all", [_RefusesOneLoad(), _RefusesOneLoad()])
        pool = RolloutPool(addresses(servers), options=PoolOptions(rejoin_interval_s=0.1))
        await pool.start()
        try:
            with pytest.raises(WeightsRejectedError, match="short read of model.safetensors"):
                await pool.update_weights(
                    write_checkpoint(exports_dir(tmp_path / "all") / "v2", "v2"), 2)
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    asyncio.run(all_refuse())


class _AlwaysRefuses(ArithmeticEngine):
    """Refuses every checkpoint but the one it started with (a path outside its allowed roots,
    say); counts the tries."""

    tries = 0

    async def update_weights(self, path: str, version: int) -> None:
        self.tries += 1
        raise WeightLoadError("not under weights_allowed_roots")


def test_a_server_that_keeps_refusing_its_weights_is_given_up_on(tmp_path, caplog):
    # It was tried again for ever (each try sending the whole checkpoint), at most every 10 min.
    async def main():
        refuser = _AlwaysRefuses()
        servers = await start_servers(tmp_path, [ArithmeticEngine(), refuser])
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            max_attempts=3, rejoin_interval_s=0.02, max_rejoin_backoff_s=0.1))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        try:
            await pool.update_weights(write_checkpoint(exports_dir(tmp_path) / "v1", "v1"), 1)
            live = pool.live_servers
            deadline = time.monotonic() + 20
            while "stays out of the pool" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            tries = refuser.tries
            await asyncio.sleep(0.5)  # some 25 supervisor rounds
            return live, tries, refuser.tries
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    live, tries, later = asyncio.run(main())
    assert len(live) == 1 and "failed to take the weights 3 times in a row" in caplog.text
    assert tries == later == 4  # the update, then three rejoins


def test_a_server_kept_out_of_the_pool_rejoins_once_it_is_restarted(tmp_path, caplog):
    # A server kept out for the rest of the run was never taken back, even after an operator
    # restarted it healthy: the run lost that server's share of the rollouts for good.
    async def main():
        refuser = _AlwaysRefuses()
        servers = await start_servers(tmp_path, [ArithmeticEngine(), refuser])
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            max_attempts=3, rejoin_interval_s=0.02, max_rejoin_backoff_s=0.1))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        try:
            await pool.update_weights(write_checkpoint(exports_dir(tmp_path) / "v1", "v1"), 1)
            deadline = time.monotonic() + 20
            while "stays out of the pool until it is restarted" not in caplog.text:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # the same process, asked some 25 times: still out
            out = (list(pool.live_servers), refuser.tries)
            port = servers[1].port
            await servers[1].stop(grace=0)
            restarted = ArithmeticEngine()
            servers[1:] = await start_servers(tmp_path / "again", [restarted], port=port,
                                              weights_allowed_roots=[str(tmp_path)])
            while len(pool.live_servers) < 2:
                assert time.monotonic() < deadline + 20, "the restarted server never rejoined"
                await asyncio.sleep(0.02)
            futures = [pool.submit(rollout_request(item, f"{i}:again", "exact", 1, 4, 1.0))
                       for i, item in enumerate(items(16))]
            groups = await asyncio.gather(*futures)
            return out, restarted, groups
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    (live, tries), restarted, groups = asyncio.run(main())
    assert live == ["127.0.0.1:" + live[0].split(":")[1]] and tries == 4
    assert restarted.version == 1  # brought to the current weights before any work
    assert restarted.requests and all(not g.HasField("error") for g in groups)
    assert "was restarted; it may rejoin the pool" in caplog.text


def test_a_server_refusing_keepalive_pings_leaves_without_charging_its_groups(
        tmp_path, caplog, monkeypatch):
    # A server on gRPC's default ping policy (an older server, a proxy) ends the connection
    # with "too many pings": its groups must not be charged a failed send each time.
    import grpc

    server_of = grpc.aio.server
    monkeypatch.setattr(grpc.aio, "server", lambda *a, options=(), **k: server_of(
        *a, options=[o for o in options if "ping" not in o[0]], **k))

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine(step_s=2.0)])
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            keepalive_s=0.2, max_attempts=1, rejoin_interval_s=60))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        try:
            future = pool.submit(rollout_request(items(1)[0], "0:slow", "exact", 1, 4, 1.0))
            deadline = time.monotonic() + 20
            while "refuses the trainer's keepalive pings" not in caplog.text:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            return future.done()
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    assert asyncio.run(main()) is False  # charged once, it would have failed (max_attempts 1)
    assert "stays out of the pool until it is restarted" in caplog.text  # not for ever


def test_versions_kept_for_the_curve_are_written_even_when_superseded(tmp_path):
    # With a delivery slower than a step, the publisher published only the newest waiting
    # snapshot: versions that trainer.export_keep_every keeps were never written.
    from areal_jax.controller.publisher import Publisher

    written, delivered = [], []

    class Snap:
        def __init__(self, version):
            self.version, self.kept = version, version % 2 == 0

        def write(self):
            time.sleep(0.2)  # submits arrive while it writes
            written.append(self.version)
            return tmp_path / f"v{self.version}"

    class SlowPool:
        async def update_weights(self, path, version, push=False):
            await asyncio.sleep(0.05)
            delivered.append(version)

    async def main():
        publisher = Publisher(SlowPool(), published=0)
        for version in range(1, 9):
            publisher.submit(Snap(version))
            await asyncio.sleep(0.05)
        await publisher.flush()
        await publisher.close()
        return publisher

    publisher = asyncio.run(main())
    assert publisher.skipped > 0 and publisher.published == 8
    assert {2, 4, 6, 8} <= set(written) and written == sorted(written)
    assert delivered == sorted(delivered) and delivered[-1] == 8
    assert set(delivered) < set(written)  # the superseded kept ones written, not delivered


def test_a_failure_after_a_version_is_delivered_is_reported_as_itself(tmp_path):
    # The callback after a delivery (the loop's ledger write) raising ENOSPC surfaced as "the
    # publishing task ended unexpectedly", the real error only in an asyncio warning.
    from areal_jax.controller.publisher import Publisher

    class Snap:
        version = 1

        def write(self):
            return tmp_path / "v1"

    class Pool:
        async def update_weights(self, path, version, push=False):
            pass

    def full_disk(version, timings):
        raise OSError(28, "No space left on device")

    async def main():
        publisher = Publisher(Pool(), published=0, on_published=full_disk)
        publisher.submit(Snap())
        try:
            with pytest.raises(OSError, match="No space left on device"):
                await publisher.flush()
        finally:
            await publisher.close()

    asyncio.run(main())


def test_a_request_the_ledger_cannot_record_is_not_sent_and_stays_pending(tmp_path,
                                                                         monkeypatch):
    # The ledger's "submit" line was written after the request was sent: a write failing (a
    # full disk) left a group running that no callback would handle and the ledger never saw.
    from areal_jax.controller.ledger import RunLedger

    class FullDiskLedger(RunLedger):
        submits = 0

        def record(self, event, **fields):
            if event == "submit":
                self.submits += 1
                if self.submits == 6:
                    raise OSError(28, "No space left on device")
            super().record(event, **fields)

    sent, loops = [], []
    submit = RolloutPool.submit
    monkeypatch.setattr(RolloutPool, "submit",
                        lambda pool, request: sent.append(request.request_id) or submit(pool, request))

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine()])
        ledger = FullDiskLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(tmp_path, config(tmp_path), RecordingTrainer(exports_dir(tmp_path)),
                                  servers, items(50), 5, ledger=ledger,
                                  during=lambda loop, pool: _keep(loops, loop))
        finally:
            ledger.close()
            for s in servers:
                await s.stop(grace=0)

    with pytest.raises(OSError, match="No space left on device"):
        asyncio.run(main())
    recorded = [e["request"] for e in read_ledger(tmp_path / "ledger.jsonl")
                if e["event"] == "submit"]
    assert len(recorded) == 5 and sent == recorded  # the sixth was not sent
    (loop,) = loops
    assert loop.pending_ids()[-1] not in {r.split(":", 1)[1] for r in recorded}  # kept


async def _keep(found: list, loop) -> None:
    found.append(loop)


class _HangingUpdates(ArithmeticEngine):
    async def update_weights(self, path: str, version: int) -> None:
        await asyncio.sleep(3600)


def test_publishing_never_waits_for_a_server_hanging_in_its_rejoin(tmp_path):
    # A server that answers SERVING but hangs loading the weights of its rejoin held the pool's
    # weights lock for update_timeout_s, and every publish waited behind it.
    async def main():
        a, b = await start_servers(tmp_path, [ArithmeticEngine(), ArithmeticEngine()])
        pool = RolloutPool([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                           options=PoolOptions(rejoin_interval_s=0.1, update_timeout_s=30))
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        port = b.port
        await b.stop(grace=0)
        while len(pool.live_servers) == 2:
            await asyncio.sleep(0.01)
        await pool.update_weights(write_checkpoint(exports_dir(tmp_path) / "v1", "v1"), 1)
        hanging = _HangingUpdates()
        (b,) = await start_servers(tmp_path, [hanging], port=port)
        await asyncio.sleep(1.0)  # its rejoin reaches the hanging update
        start = time.monotonic()
        await pool.update_weights(write_checkpoint(exports_dir(tmp_path) / "v2", "v2"), 2)
        took = time.monotonic() - start
        live = pool.live_servers
        await pool.close()
        for server in (a, b):
            await server.stop(grace=0)
        return took, live, a.port

    took, live, port_a = asyncio.run(main())
    assert took < 5, took
    assert live == [f"127.0.0.1:{port_a}"]


class _SlowUpdates(ArithmeticEngine):
    async def update_weights(self, path: str, version: int) -> None:
        await asyncio.sleep(1.5)  # a large model, a slow disk
        await super().update_weights(path, version)


def test_the_export_a_server_rejoins_with_is_not_pruned_while_it_loads(tmp_path):
    # A rejoin sends the current weights outside the publishing lock; publishing went on and
    # pruned the export the server was still reading: its rejoin failed, again each try.
    from areal_jax.trainer import export_path, prune_exports

    exports = exports_dir(tmp_path)

    async def main():
        a, b = await start_servers(tmp_path, [ArithmeticEngine(), ArithmeticEngine()])
        pool = RolloutPool([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                           options=PoolOptions(rejoin_interval_s=0.1))
        await pool.start()
        await pool.update_weights(write_checkpoint(export_path(exports, 1), "v1"), 1)
        port = b.port
        await b.stop(grace=0)
        while len(pool.live_servers) == 2:
            await asyncio.sleep(0.01)
        slow = _SlowUpdates()
        (b,) = await start_servers(tmp_path, [slow], port=port)
        await asyncio.sleep(0.8)  # its rejoin is loading version 1
        for v in (2, 3):
            write_checkpoint(export_path(exports, v), f"v{v}")
        pruned = prune_exports(exports, keep=1)
        deadline = time.monotonic() + 10
        while len(pool.live_servers) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await pool.close()
        for server in (a, b):
            await server.stop(grace=0)
        return pruned, slow.loaded

    pruned, loaded = asyncio.run(main())
    assert export_path(exports, 1) not in pruned  # in use by the rejoin
    assert [(Path(path).name, version) for path, version, _ in loaded] == [("v000001", 1)]
    assert prune_exports(exports, keep=1) == [export_path(exports, 1)]  # once it is done


def test_a_defect_handling_a_result_stops_the_run_instead_of_hanging_it(tmp_path, monkeypatch):
    # Raised in a future's done-callback, the error vanished into the event loop's log: the
    # group was neither buffered nor pending, and the loop waited for it forever.
    from areal_jax.controller import loop as loop_module

    def broken(*args):
        raise ZeroDivisionError("defect")

    monkeypatch.setattr(loop_module._Finished, "of", broken)
    trainer = RecordingTrainer(exports_dir(tmp_path))
    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="defect"):
        run_on_servers(tmp_path, [ArithmeticEngine()], config(tmp_path), trainer, items(20), 3)
    assert time.monotonic() - start < 30 and not trainer.batches


def test_inserted_tokens_do_not_make_groups_overstale(tmp_path):
    # A workflow's inserted tokens carry version -1 (mask 0); counted as the group's oldest,
    # every group with one looked η + 1 versions stale and the run dropped groups forever.
    prompts = items(100)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    cfg = config(tmp_path, {"batch_size": 2, "max_staleness": 1, "overstale": "drop"},
                 sampling={"max_new_tokens": 12})
    workflow = {"path": "rollout.workflows.examples.CheckYourAnswerWorkflow",
                "options": {"check_text": "?"}}

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine()], workflow=workflow)
        try:
            return await asyncio.wait_for(run_loop(tmp_path, cfg, trainer, servers, prompts, 6), 60)
        finally:
            await servers[0].stop(grace=0.5)

    loop = asyncio.run(main())
    trajectories = [t for _, groups in trainer.batches for g in groups for t in g.trajectories]
    assert len(trainer.batches) == 6 and any((t.versions == -1).any() for t in trajectories)
    assert loop.metrics[-1]["rollout/dropped_overstale"] <= 2 * 8  # what η allows, not all


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
            for s in servers:
                await s.stop(grace=0.5)

    asyncio.run(main())
    assert engine.loaded[0][1] == 3
    # A fresh server also calls its starting checkpoint version 0: it must still get the
    # trainer's version 0 (the SFT model), which a comparison of versions skipped.
    fresh = ArithmeticEngine(version=0)

    async def fresh_start():
        servers = await start_servers(tmp_path / "fresh", [fresh])
        pool = RolloutPool([f"127.0.0.1:{servers[0].port}"])
        await pool.start()
        try:
            await sync_servers(pool, write_checkpoint(exports_dir(tmp_path / "fresh") / "sft",
                                                      "sft"), 0, config(tmp_path))
        finally:
            await pool.close()
            await servers[0].stop(grace=0)

    asyncio.run(fresh_start())
    assert [(Path(path).name, version) for path, version, _ in fresh.loaded] == [("sft", 0)]
    for version, groups in trainer.batches:
        for g in groups:
            for t in g.trajectories:
                assert int(t.versions.max()) <= version, (version, t.versions)


def test_a_server_that_never_answers_at_start_is_named():
    from areal_jax.controller.local_servers import free_port
    from areal_jax.controller.rollout_pool import NoLiveServerError

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(NoLiveServerError, match=rf"no rollout server answered within 1 s "
                       rf"\(rollout.start_timeout_s; tried {address}\): not started yet, "
                       "unreachable, or TLS on one side"):
        asyncio.run(RolloutPool([address]).start(ready_timeout_s=1))


def test_the_run_waits_for_its_first_server_as_long_as_start_timeout_s_says(tmp_path):
    """A large model's servers can take longer than the default 300 s to start: the wait is the
    config's, not a constant."""
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.local_servers import free_port
    from areal_jax.controller.rollout_pool import NoLiveServerError
    from areal_jax.controller.servers import rollout_servers
    from areal_jax.experiment import ExperimentConfig

    address = f"127.0.0.1:{free_port()}"
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    cfg = load_config(ExperimentConfig, quickstart, [f"run_dir={tmp_path}",
                                                     f'rollout.addresses=["{address}"]',
                                                     "rollout.start_timeout_s=0.5"])

    async def start():
        async with rollout_servers(cfg, tmp_path, 0):
            pass

    began = time.monotonic()
    with pytest.raises(NoLiveServerError, match=r"within 0.5 s \(rollout.start_timeout_s"):
        asyncio.run(start())
    assert time.monotonic() - began < 30
    with pytest.raises(ConfigError, match=r"rollout.start_timeout_s: must be > 0, got 0"):
        load_config(ExperimentConfig, quickstart, ["rollout.start_timeout_s=0"])


async def _connect_error(tmp_path, engine, overrides=(), server=None, **lengths) -> str | None:
    """The ConfigError a trainer of the quickstart config (answers of 30 tokens, ``exact``
    rewards, ``overrides``) meets connecting to a server of ``engine`` (and ``server``
    settings) with prompts of ``lengths`` (``rollout_servers``'s ``training`` and
    ``held_out``), or None."""
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.servers import rollout_servers
    from areal_jax.experiment import ExperimentConfig

    servers = await start_servers(tmp_path, [engine], **(server or {}))
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    cfg = load_config(ExperimentConfig, quickstart, [
        f"run_dir={tmp_path}", f"rollout.addresses={addresses(servers)}",
        "sampling.max_new_tokens=30", "eval.max_new_tokens=30", "dataset.reward=exact",
        "eval.dataset.reward=exact", *overrides])
    try:
        async with rollout_servers(cfg, tmp_path, 0, **lengths):
            return None
    except ConfigError as e:
        return str(e)
    finally:
        await asyncio.gather(*(s.stop(grace=1.0) for s in servers))


def test_servers_whose_context_cannot_hold_the_prompts_and_answers_are_named_at_connect(
        tmp_path):
    # A remote server (or an SGLang whose KV pool serves less than the model's context)
    # rejected each long request in the loop: the prompts were skipped one by one with a
    # warning, or the run stopped after max_consecutive_rejections, with no word of the context.
    def connect(**lengths):
        return asyncio.run(_connect_error(tmp_path, ArithmeticEngine(max_context_len=64),
                                          ["eval.max_new_tokens=50"], **lengths))

    assert connect(training=[20, 34], held_out=[14]) is None
    address = "127.0.0.1:\\d+"
    assert re.fullmatch(
        rf"the context rollout server {address} serves \(64 tokens\) is below the longest "
        r"training prompt \(35 tokens\) \+ sampling.max_new_tokens \(30\) = 65: the "
        r"servers would reject those requests; serve a longer one there or lower "
        r"sampling.max_new_tokens", connect(training=[20, 35]))
    assert re.match(rf"the context rollout server {address} serves \(64 tokens\) is below "
                    r"the longest held-out prompt \(15 tokens\)", connect(held_out=[15]))


def test_servers_that_do_not_offer_the_runs_rewards_are_named_at_connect(tmp_path):
    # A remote server without the training reward in its rewards.custom rejected every group
    # in the loop (a warning each) until the run stopped after max_consecutive_rejections.
    def connect(overrides, **lengths):
        return asyncio.run(_connect_error(tmp_path, ArithmeticEngine(), overrides, **lengths))

    mine = "mypkg.rewards:score"
    assert connect([], training=[20], held_out=[14]) is None
    refused = connect([f"dataset.reward={mine}"], training=[20], held_out=[14])
    assert re.fullmatch(
        r"rollout server 127.0.0.1:\d+ does not offer the reward 'mypkg.rewards:score' "
        r"\(dataset.reward\): it offers exact; add it to that server's rewards.custom "
        r'\(name: "pkg.module:function"\) and start it again', refused)
    # Only what is asked of the servers counts: an evaluation alone needs its own reward.
    assert connect([f"dataset.reward={mine}"], held_out=[14]) is None
    assert "(eval.dataset.reward)" in connect([f"eval.dataset.reward={mine}"], held_out=[14])


def test_a_server_that_takes_smaller_groups_than_the_run_asks_is_named_at_connect(tmp_path):
    # It rejected every training request as the request's own fault: the run stopped after
    # max_consecutive_rejections, its prompts dropped, the server named nowhere.
    def connect(group_size, **lengths):
        return asyncio.run(_connect_error(tmp_path, ArithmeticEngine(),
                                          [f"sampling.group_size={group_size}"],
                                          server={"max_group_size": 4}, **lengths))

    assert connect(4, training=[20], held_out=[14]) is None
    assert re.fullmatch(
        r"rollout server 127.0.0.1:\d+ takes groups of at most 4 samples \(its max_group_size"
        r"\), this run asks for sampling.group_size 5: raise max_group_size there \(and start "
        r"it again\) or lower sampling.group_size", connect(5, training=[20], held_out=[14]))
    assert connect(5, held_out=[14]) is None  # evaluation alone asks one sample per prompt


def test_servers_join_and_leave_a_running_pool_as_the_addresses_file_changes(
        tmp_path, caplog, monkeypatch):
    # Rollout scaled only by restarting the trainer with a longer rollout.addresses.
    from areal_jax.controller import rollout_pool
    from areal_jax.controller.ledger import RunLedger

    real_read, torn = rollout_pool.read_addresses_file, {"left": 0, "reads": 0}

    def read(path):
        torn["reads"] += 1
        if torn["left"]:  # the file caught truncated, before its lines were written again
            torn["left"] -= 1
            return []
        return real_read(path)

    monkeypatch.setattr(rollout_pool, "read_addresses_file", read)

    prompts = items(400)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    first, second = ArithmeticEngine(step_s=0.01), ArithmeticEngine(step_s=0.01)
    listing = tmp_path / "servers.txt"
    seen = {}

    def write(*lines):
        listing.with_suffix(".new").write_text("".join(f"{line}\n" for line in lines))
        listing.with_suffix(".new").replace(listing)

    async def during(loop, pool, a, b):
        async def until(condition, what):
            deadline = time.monotonic() + 30
            while not condition():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        await until(lambda: loop.version >= 3, "no version 3")
        seen["before"] = len(second.requests)
        write("# the first server, then one added", a, b)
        await until(lambda: len(second.requests) > 0, "the added server got no work")
        await until(lambda: loop.version >= 10, "no version 10")
        write(b, "not an address")  # a bad line: nothing changes
        await until(lambda: "line 2" in caplog.text, "the bad line was not named")
        seen["bad"] = list(pool.live_servers)
        write(a, b)
        torn["left"], reads = 1, torn["reads"]
        await until(lambda: torn["reads"] >= reads + 4, "the file was not read again")
        seen["torn"] = "no longer listed" in caplog.text  # a server taken out for it
        write(b)
        await until(lambda: pool.live_servers == [b], "the removed server stayed")
        seen["removed_at"] = len(first.requests)

    async def main():
        servers = await start_servers(tmp_path, [first, second])
        a, b = addresses(servers)
        seen["b"] = b
        write(a)
        ledger = RunLedger(tmp_path / "ledger.jsonl")
        try:
            return await run_loop(
                tmp_path, config(tmp_path, {"max_staleness": 2}), trainer, servers, prompts, 30,
                options=PoolOptions(rejoin_interval_s=0.05), ledger=ledger,
                during=lambda loop, pool: during(loop, pool, a, b), addresses_file=listing)
        finally:
            ledger.close()
            for server in servers:
                await server.stop(grace=0.5)

    loop = asyncio.run(main())
    assert trainer.version == 30
    assert seen["before"] == 0 and len(seen["bad"]) == 2 and not seen["torn"]
    assert len(first.requests) == seen["removed_at"]  # no work after its removal
    assert loop.live_at_end == [seen["b"]]
    assert caplog.text.count("rollout.addresses_file: ") == 1
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)


@contextlib.asynccontextmanager
async def _unlisting_a_busy_server(tmp_path, caplog, slow, fast):
    """Servers for ``slow`` and ``fast`` listed in a file a pool follows; six groups submitted;
    once ``slow`` generates, its line removed and the pool's notice of it waited for. Yields
    (pool, slow's address, fast's address, the futures, the file)."""
    listing = tmp_path / "servers.txt"
    servers = await start_servers(tmp_path, [slow, fast])
    a, b = addresses(servers)
    listing.write_text(f"{a}\n{b}\n")
    pool = RolloutPool([], options=PoolOptions(rejoin_interval_s=0.05), addresses_file=listing)
    await pool.start()
    pool.record_weights(exports_dir(tmp_path) / "base", 0)
    try:
        futures = [pool.submit(rollout_request(item, f"{i}:x", "exact", 2, 6, 1.0))
                   for i, item in enumerate(items(6))]
        deadline = time.monotonic() + 30
        while not slow.active:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        listing.write_text(f"{b}\n")
        while "no longer listed" not in caplog.text:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        yield pool, a, b, futures, listing
    finally:
        await pool.close()
        for server in servers:
            await server.stop(grace=0)


def test_an_unlisted_server_finishes_the_groups_it_holds_and_gets_no_new_work(tmp_path, caplog):
    # Its groups were sent again elsewhere, the work it had done thrown away.
    slow, fast = ArithmeticEngine(step_s=0.2), ArithmeticEngine(step_s=0.001)

    async def main():
        async with _unlisting_a_busy_server(tmp_path, caplog, slow, fast) as (
                pool, _, b, futures, _):
            held = len(slow.requests)
            later = [pool.submit(rollout_request(item, f"{i}:y", "exact", 2, 6, 1.0))
                     for i, item in enumerate(items(6))]
            groups = await asyncio.gather(*futures, *later)
            return held, groups, pool.resubmitted, list(pool.live_servers), b

    held, groups, resubmitted, live, b = asyncio.run(main())
    assert held and len(slow.requests) == held  # nothing new went to it
    assert all(not g.HasField("error") for g in groups) and resubmitted == 0
    assert live == [b]
    assert "left the pool (unlisted, its last group back); resubmitting its 0 groups" in (
        caplog.text)


def test_a_server_listed_again_while_it_leaves_stays_with_its_groups(tmp_path, caplog):
    # A second pool entry was made for the same server: the next weight update reached it
    # twice, it refused the second copy as not newer, and the leaving entry's groups were
    # thrown away and generated again.
    slow, fast = ArithmeticEngine(step_s=0.3), ArithmeticEngine(step_s=0.001)

    async def main():
        async with _unlisting_a_busy_server(tmp_path, caplog, slow, fast) as (
                pool, a, b, futures, listing):
            listing.write_text(f"{a}\n{b}\n")
            deadline = time.monotonic() + 30
            while len(pool.live_servers) < 2:  # back in the pool, as one entry or two
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await pool.update_weights(write_checkpoint(exports_dir(tmp_path) / "v1", "v1"), 1)
            groups = await asyncio.gather(*futures)
            return groups, pool.resubmitted, sorted(pool.live_servers), sorted([a, b])

    groups, resubmitted, live, both = asyncio.run(main())
    assert all(not g.HasField("error") for g in groups) and resubmitted == 0
    assert live == both and slow.version == 1
    assert "refused" not in caplog.text


def test_a_request_parked_while_the_only_server_leaves_runs_once_it_is_listed_again(
        tmp_path, caplog):
    # Only a server's (re)opened stream routed the requests parked while no server took work,
    # and the one listed again before it left was never reopened: what was submitted in
    # between waited for good (a server alive, the no-server timeout never came either), its
    # slot of the staleness gate held.
    slow = ArithmeticEngine(step_s=0.3)
    listing = tmp_path / "servers.txt"

    async def until(condition, what):
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def main():
        servers = await start_servers(tmp_path, [slow])
        (a,) = addresses(servers)
        listing.write_text(f"{a}\n")
        pool = RolloutPool([], options=PoolOptions(rejoin_interval_s=0.05,
                                                   no_server_timeout_s=2.0),
                           addresses_file=listing)
        await pool.start()
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        try:
            held = [pool.submit(rollout_request(item, f"{i}:x", "exact", 2, 6, 1.0))
                    for i, item in enumerate(items(2))]
            await until(lambda: slow.active, "the server never generated")
            listing.write_text("# none for now\n")
            await until(lambda: "no longer listed" in caplog.text, "not unlisted")
            parked = pool.submit(rollout_request(items(3)[2], "2:y", "exact", 2, 6, 1.0))
            listing.write_text(f"{a}\n")
            await until(lambda: "listed again" in caplog.text, "not listed again")
            await asyncio.gather(*held)
            return await asyncio.wait_for(parked, 10.0)
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    group = asyncio.run(main())
    assert not group.HasField("error") and len(group.trajectories) == 2


def test_a_server_joining_later_with_too_short_a_context_stays_out_of_the_pool(tmp_path, caplog):
    # The context check ran once, at the start: a server that joined later (down at the start,
    # or restarted with other settings) took the run's requests and rejected the long ones,
    # until the run stopped after max_consecutive_rejections.
    from areal_jax.config import load_config
    from areal_jax.controller.local_servers import free_port
    from areal_jax.controller.servers import rollout_servers
    from areal_jax.experiment import ExperimentConfig

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine(max_context_len=200)])
        port = free_port()
        quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
        (tmp_path / "more.txt").write_text(f"127.0.0.1:{port}\n")  # config to pool, too
        cfg = load_config(ExperimentConfig, quickstart, [
            f"run_dir={tmp_path}", f"rollout.addresses={addresses(servers)}",
            f"rollout.addresses_file={tmp_path / 'more.txt'}", "sampling.max_new_tokens=30",
            "rollout.rejoin_interval_s=0.05", "rollout.start_timeout_s=0.5",
            "dataset.reward=exact"])
        try:
            async with rollout_servers(cfg, tmp_path, 0, training=[35]) as (pool, _):
                servers += await start_servers(tmp_path / "short", [ArithmeticEngine(
                    max_context_len=64)], port=port, weights_allowed_roots=[str(tmp_path)])
                deadline = time.monotonic() + 20
                while "stays out of the pool until it is restarted" not in caplog.text:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                kept_out = list(pool.live_servers)
                await servers.pop().stop(grace=0)
                servers += await start_servers(tmp_path / "long", [ArithmeticEngine(
                    max_context_len=200)], port=port, weights_allowed_roots=[str(tmp_path)])
                while len(pool.live_servers) < 2:
                    assert time.monotonic() < deadline + 20, "the restarted server never joined"
                    await asyncio.sleep(0.05)
                return kept_out, addresses(servers)[0]
        finally:
            await asyncio.gather(*(s.stop(grace=0) for s in servers))

    kept_out, first = asyncio.run(main())
    assert kept_out == [first]
    assert re.search(r"rollout server 127.0.0.1:\d+ cannot serve this run: the context rollout "
                     r"server 127.0.0.1:\d+ serves \(64 tokens\) is below the longest training "
                     r"prompt \(35 tokens\)", caplog.text)


def test_a_server_of_another_model_is_refused_at_connect(tmp_path):
    # It took the run's requests and answered with its own model's token ids.
    from areal_jax.config import ConfigError, load_config
    from areal_jax.controller.servers import rollout_servers
    from areal_jax.experiment import ExperimentConfig

    async def connect(vocab_size):
        servers = await start_servers(tmp_path, [ArithmeticEngine()])
        quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
        cfg = load_config(ExperimentConfig, quickstart, [
            f"run_dir={tmp_path}", f"rollout.addresses={addresses(servers)}"])
        try:
            async with rollout_servers(cfg, tmp_path, 0, vocab_size=vocab_size):
                return None
        except ConfigError as e:
            return str(e)
        finally:
            await asyncio.gather(*(s.stop(grace=1.0) for s in servers))

    vocab = ArithmeticEngine().vocab_size
    assert asyncio.run(connect(vocab)) is None
    assert re.fullmatch(rf"rollout server 127.0.0.1:\d+ serves a model with a vocabulary of "
                        rf"{vocab}, the trainer's has {vocab + 1}: another model; start it with "
                        r"this run's model", asyncio.run(connect(vocab + 1)))


def test_a_server_down_at_start_joins_later_and_a_wrong_token_is_named_at_once(
        tmp_path, monkeypatch):
    # One server down at the trainer's start failed the run after the ready timeout (300 s),
    # the others unused; a wrong token waited out no_server_timeout_s (300 s), then said no
    # server had been reachable.
    from areal_jax.controller.local_servers import free_port
    from areal_jax.controller.rollout_pool import ServerRefusedError

    monkeypatch.setenv("AREAL_TEST_TOKEN", "right")

    async def main():
        (up,) = await start_servers(tmp_path, [ArithmeticEngine()],
                                    auth_token_env="AREAL_TEST_TOKEN")
        late_port = free_port()
        addresses = [f"127.0.0.1:{up.port}", f"127.0.0.1:{late_port}"]
        with pytest.raises(ServerRefusedError, match="refuses the trainer: UNAUTHENTICATED"):
            await RolloutPool(addresses, auth_token="wrong").start(ready_timeout_s=1)
        pool = RolloutPool(addresses, auth_token="right",
                           options=PoolOptions(rejoin_interval_s=0.1))
        began = time.monotonic()
        await pool.start(ready_timeout_s=1)
        started = (pool.live_servers, time.monotonic() - began)
        pool.record_weights(exports_dir(tmp_path) / "base", 0)
        (late,) = await start_servers(tmp_path / "late", [ArithmeticEngine()], port=late_port,
                                      auth_token_env="AREAL_TEST_TOKEN")
        while len(pool.live_servers) < 2:
            await asyncio.sleep(0.05)
        await pool.close()
        for server in (up, late):
            await server.stop(grace=0)
        return addresses, started

    addresses, (live, took) = asyncio.run(main())
    assert live == addresses[:1] and took < 5


def test_an_evaluation_whose_every_request_fails_names_the_first_error(tmp_path, caplog):
    # Each request was refused (a server without the run's reward): the accuracy was NaN on 0
    # prompts, no reason given, RL started anyway and the NaN was kept as the before-RL figure.
    from areal_jax.controller.evaluation import EvaluationFailedError, evaluate

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine()])
        pool = RolloutPool(addresses(servers))
        await pool.start(ready_timeout_s=10)
        try:
            with pytest.raises(EvaluationFailedError, match=r"every one of the 4 held-out "
                               r"evaluation requests failed; the first: .*no_such_reward"):
                await evaluate(pool, items(4), "no_such_reward", max_new_tokens=6)
            inside_a_run = await evaluate(pool, items(4), "no_such_reward", max_new_tokens=6,
                                          strict=False)
            return inside_a_run, await evaluate(pool, items(4), "exact", max_new_tokens=6)
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    inside_a_run, result = asyncio.run(main())
    assert inside_a_run["eval/failed"] == 4 and np.isnan(inside_a_run["eval/accuracy"])
    assert result["eval/num_prompts"] == 4 and result["eval/failed"] == 0
    assert 0 < result["eval/seconds"] < 60  # its wall time


def test_an_evaluation_whose_every_reward_call_fails_names_the_error(tmp_path):
    # A reward reading a key the eval data does not map: accuracy 0.000 before and after RL,
    # the run finished normally, the failures only in a warning and results.json.
    from areal_jax.controller.evaluation import EvaluationFailedError, evaluate

    async def main():
        servers = await start_servers(tmp_path, [ArithmeticEngine()], scorer=FailingScorer)
        pool = RolloutPool(addresses(servers))
        await pool.start(ready_timeout_s=10)
        try:
            with pytest.raises(EvaluationFailedError, match=r"every one of the 4 reward calls "
                               r"of the held-out evaluation failed \(reward 'exact'\), so every "
                               r"answer would score 0; the first: .*KeyError: 'no_such_key'"):
                await evaluate(pool, items(4), "exact", max_new_tokens=6)
            return await evaluate(pool, items(4), "exact", max_new_tokens=6, strict=False)
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    inside_a_run = asyncio.run(main())
    assert inside_a_run["eval/reward_failures"] == 4 and inside_a_run["eval/accuracy"] == 0


def test_an_evaluation_request_failing_after_its_attempts_is_counted_not_raised(tmp_path):
    # One held-out prompt that failed on the servers after its attempts (INTERNAL each time)
    # raised out of the evaluation: the run stopped, that version's checkpoint unwritten.
    from areal_jax.controller.evaluation import evaluate

    prompts = items(4)

    class OnePromptCrashes(ArithmeticEngine):
        def generate(self, prompt_ids, params, request_id):
            if list(prompt_ids) == prompts[2].prompt_ids:
                raise RuntimeError("decoding this answer crashes")
            return super().generate(prompt_ids, params, request_id)

    async def main():
        servers = await start_servers(tmp_path, [OnePromptCrashes()])
        pool = RolloutPool(addresses(servers), options=PoolOptions(max_attempts=2))
        await pool.start(ready_timeout_s=10)
        try:
            alone = await evaluate(pool, prompts[2:3], "exact", max_new_tokens=6, strict=False)
            assert alone["eval/failed"] == 1
            live = pool.live_servers
            return await evaluate(pool, prompts, "exact", max_new_tokens=6, strict=False), live
        finally:
            await pool.close()
            for server in servers:
                await server.stop(grace=0)

    result, live = asyncio.run(main())
    assert result["eval/failed"] == 1 and result["eval/num_prompts"] == 3, result
    # One group failing again and again (here alone) is that group's failure, not its
    # server's: the only server stayed in the pool.
    assert len(live) == 1


class _LateSecondResume(ArithmeticEngine):
    """Its second resume outlives the caller's deadline and never takes effect (the JAX
    engine's worker drops a command whose caller gave up)."""

    resumes = 0

    async def resume(self):
        self.resumes += 1
        if self.resumes == 2:
            await asyncio.sleep(3)
        await super().resume()


def test_a_synchronous_run_whose_resume_was_lost_resumes_its_server_and_finishes(tmp_path):
    # The pool took the server out on the resume's deadline; it rejoined still paused, got the
    # parked groups, and the stall check kept it ("paused" counted as progress): the run waited
    # for good at version 2.
    engine = _LateSecondResume(step_s=0.002)
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    options = PoolOptions(rejoin_interval_s=0.2, rpc_timeout_s=1.0, stall_timeout_s=1.0)
    cfg = config(tmp_path, {"batch_size": 3, "mode": "sync"})
    loop = run_on_servers(tmp_path, [engine], cfg, trainer, items(200), 6, options=options)
    assert trainer.version == 6 and len(loop.metrics) == 6 and not engine.paused
    assert engine.resumes >= 6  # the lost one, then the pool's own at the stall check


def test_servers_left_paused_are_resumed_and_a_closing_pool_resumes_what_it_paused(
        tmp_path, caplog):
    # A run stopped (Ctrl-C, SIGTERM, SIGKILL) in a synchronous step left its servers paused:
    # the next run's groups waited on them for good.
    async def scenario():
        engine = ArithmeticEngine(step_s=0.002)
        servers = await start_servers(tmp_path, [engine])
        try:
            pool = RolloutPool(addresses(servers))
            await pool.start()
            await pool.pause()
            paused = engine.paused
            await pool.close()
            after_close = engine.paused
            await engine.pause()  # as a SIGKILLed trainer leaves it
            pool = RolloutPool(addresses(servers))
            await pool.start()
            after_start = engine.paused
            group = await pool.submit(rollout_request(items(1)[0], "r", "exact", 2, 4, 1.0))
            await pool.close()
            return paused, after_close, after_start, group
        finally:
            for s in servers:
                await s.stop(grace=0.5)

    paused, after_close, after_start, group = asyncio.run(scenario())
    assert (paused, after_close, after_start) == (True, False, False)
    assert len(group.trajectories) == 2
    assert re.search(r"rollout server 127.0.0.1:\d+ was paused, not by this run's current "
                     r"trainer; resumed", caplog.text)


def test_a_pool_leaves_alone_the_pause_of_a_server_another_run_holds(tmp_path):
    # Another run's pool (an evaluation, a second trainer) connecting to a synchronous run's
    # servers resumed them in the middle of its step.
    async def scenario():
        engine = ArithmeticEngine(step_s=0.002)
        servers = await start_servers(tmp_path, [engine])
        try:
            mine = RolloutPool(addresses(servers), run_id="run-a")
            await mine.start()
            await mine.update_weights(exports_dir(tmp_path) / "base", 1)  # the server is ours
            await mine.pause()
            other = RolloutPool(addresses(servers), run_id="run-b")
            await other.start()
            during = engine.paused
            await other.close()
            await mine.close()
            return during, engine.paused
        finally:
            for s in servers:
                await s.stop(grace=0.5)

    assert asyncio.run(scenario()) == (True, False)  # paused while run-a held it


class _SlowLoad(ArithmeticEngine):
    async def update_weights(self, path, version):
        await asyncio.sleep(0.5)
        await super().update_weights(path, version)


def test_a_server_rejoins_while_versions_are_published_faster_than_it_loads(tmp_path):
    # Each forced load of its rejoin ended just after the next version was published: it
    # loaded again and again (39 versions in 20 s) and never rejoined.
    engines = [_SlowLoad(step_s=0.002) for _ in range(2)]
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.05)
    seen = {}

    async def during(loop, pool, servers):
        while trainer.version < 3:
            await asyncio.sleep(0.01)
        pool._mark_dead(pool._servers[0], "a network blip")
        start = time.monotonic()
        while len(pool.live_servers) < 2 and time.monotonic() - start < 15:
            await asyncio.sleep(0.05)
        seen["live"], seen["loads"] = len(pool.live_servers), len(engines[0].loaded)

    cfg = config(tmp_path, {"batch_size": 3, "max_staleness": 4, "max_in_flight": 16})
    run_on_servers(tmp_path, engines, cfg, trainer, items(2000), 40, during=during,
                   options=PoolOptions(rejoin_interval_s=0.2))
    assert seen["live"] == 2 and seen["loads"] <= 4  # at most two loads for its rejoin


class _HttpErrorEngine(ArithmeticEngine):
    """Every request fails with an engine error (SGLang's /generate answering HTTP 500), its
    health SERVING."""

    async def generate(self, prompt_ids, params, request_id):
        raise EngineError("SGLang /generate answered HTTP 500")
        yield


def test_a_server_that_fails_each_time_it_rejoins_is_struck_then_kept_out(tmp_path, caplog):
    # Out with no strike, back after rejoin_interval_s, failing its new groups at once: 99
    # times in 20 s, a warning each, for the rest of the run.
    trainer = RecordingTrainer(exports_dir(tmp_path), train_s=0.02)
    cfg = config(tmp_path, {"batch_size": 3, "max_staleness": 2})
    loop = run_on_servers(tmp_path, [_HttpErrorEngine(), ArithmeticEngine(step_s=0.01)], cfg,
                          trainer, items(3000), 120,
                          options=PoolOptions(rejoin_interval_s=0.1, max_attempts=3))
    left = [r for r in caplog.records if "left the pool" in r.getMessage()]
    assert len(left) == 3  # then out until it is restarted
    assert "stays out of the pool until it is restarted" in caplog.text
    assert trainer.version == 120 and len(loop.live_at_end) == 1
    assert_nothing_lost(tmp_path / "ledger.jsonl", items(3000))


def test_servers_that_do_not_answer_at_the_start_are_named_while_the_pool_waits(
        tmp_path, caplog):
    # A wrong port showed "connecting to the rollout servers", then nothing for
    # start_timeout_s (300 s).
    async def scenario():
        servers = await start_servers(tmp_path, [ArithmeticEngine()])
        try:
            pool = RolloutPool([*addresses(servers), "127.0.0.1:1"])
            await pool.start(ready_timeout_s=1.0, report_every_s=0.3)
            live = pool.live_servers
            await pool.close()
            return live
        finally:
            await servers[0].stop(grace=0.5)

    live = asyncio.run(scenario())
    assert len(live) == 1 and live != ["127.0.0.1:1"]  # the other one joins later, if ever
    named = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("waiting for rollout servers to answer: ")]
    assert named and all(m.startswith("waiting for rollout servers to answer: 127.0.0.1:1 (")
                         for m in named)


class _SlowThenHangingLoads(ArithmeticEngine):
    """Its first load after ``armed`` takes 1 s, every later one hangs."""

    armed, loads = False, 0

    async def update_weights(self, path, version):
        if self.armed:
            self.loads += 1
            await asyncio.sleep(1.0 if self.loads == 1 else 3600)
        await super().update_weights(path, version)


class _HangingLoads(ArithmeticEngine):
    """Its loads hang while ``hang`` is set."""

    hang = False

    async def update_weights(self, path, version):
        while self.hang:
            await asyncio.sleep(0.05)
        await super().update_weights(path, version)


def test_a_server_hanging_in_a_load_leaves_the_pool_and_holds_no_publish_up(tmp_path):
    # Every publish waited for the slowest server, up to update_timeout_s (600 s by default):
    # one hung load held the whole pool's weights back, and with them the staleness gate.
    async def scenario():
        hung = _HangingLoads()
        servers = await start_servers(tmp_path, [ArithmeticEngine(), hung])
        versions = [write_checkpoint(exports_dir(tmp_path) / f"v{v}", f"v{v}") for v in (1, 2)]
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            rejoin_interval_s=0.1, rpc_timeout_s=1.0, update_timeout_s=30.0))
        try:
            await pool.start()
            hung.hang = True
            start = time.monotonic()
            await pool.update_weights(versions[0], 1)
            waited = time.monotonic() - start
            left = pool.live_servers
            hung.hang = False  # it finishes loading, and rejoins at the newest version
            await pool.update_weights(versions[1], 2)
            for _ in range(200):
                if len(pool.live_servers) == 2:
                    break
                await asyncio.sleep(0.05)
            return (waited, left, addresses(servers)[0], pool.live_servers,
                    [s.version for s in pool._servers])
        finally:
            hung.hang = False
            await pool.close()
            for s in servers:
                await s.stop(grace=0.5)

    waited, left, healthy, back, served = asyncio.run(scenario())
    assert waited < 4.0  # rpc_timeout_s (1 s) after the other server had it, not 30 s
    assert left == [healthy]
    assert len(back) == 2 and served == [2, 2]


def test_a_server_slower_than_the_others_at_each_load_stays_once_its_load_time_is_known(tmp_path):
    # The bound follows a server's own last load: one that is always slower is not taken for
    # stuck at every publish (it may leave once, before its load time is known).
    async def scenario():
        slow = _TimedLoads(1.2)
        servers = await start_servers(tmp_path, [ArithmeticEngine(), slow])
        versions = [write_checkpoint(exports_dir(tmp_path) / f"v{v}", f"v{v}") for v in (1, 2, 3)]
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            rejoin_interval_s=0.1, rpc_timeout_s=0.5, update_timeout_s=30.0))
        try:
            await pool.start()
            await pool.update_weights(versions[0], 1)  # 1.2 s against 0.5: it leaves ...
            while len(pool.live_servers) < 2:  # ... and rejoins, its load timed
                await asyncio.sleep(0.05)
            for i in (1, 2):
                await pool.update_weights(versions[i], i + 1)
                assert len(pool.live_servers) == 2, f"left at version {i + 1}"
            return slow.loads, [s.version for s in pool._servers]
        finally:
            await pool.close()
            for s in servers:
                await s.stop(grace=0.5)

    loads, served = asyncio.run(scenario())
    assert served == [3, 3]
    assert loads >= 3


class _QueuedLoads(ArithmeticEngine):
    """Its loads take 0.4 s each on a disk shared with the other servers: one at a time."""

    def __init__(self, disk: asyncio.Lock):
        super().__init__()
        self.disk = disk

    async def update_weights(self, path, version):
        async with self.disk:
            await asyncio.sleep(0.4)
        await super().update_weights(path, version)


def test_loads_queued_on_one_shared_disk_push_no_server_out(tmp_path):
    # Each publish's last load in line took four times the first: measured against the
    # fastest server, it left the pool (and its groups were sent again) at one publish in three.
    async def scenario():
        disk = asyncio.Lock()
        servers = await start_servers(tmp_path, [_QueuedLoads(disk) for _ in range(4)])
        versions = [write_checkpoint(exports_dir(tmp_path) / f"v{v}", f"v{v}") for v in range(1, 5)]
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            rejoin_interval_s=0.1, rpc_timeout_s=0.5, update_timeout_s=30.0))
        left = []
        try:
            await pool.start()
            for v, path in enumerate(versions, start=1):
                await pool.update_weights(path, v)
                left.append(4 - len(pool.live_servers))
            return left, [s.version for s in pool._servers]
        finally:
            await pool.close()
            for s in servers:
                await s.stop(grace=0.5)

    left, served = asyncio.run(scenario())
    assert left == [0, 0, 0, 0] and served == [4] * 4


class _TimedLoads(ArithmeticEngine):
    """Every load takes ``seconds``."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.loads = seconds, 0

    async def update_weights(self, path, version):
        self.loads += 1
        await asyncio.sleep(self.seconds)
        await super().update_weights(path, version)


def test_a_rejoin_load_under_the_weights_lock_holds_publishing_up_for_a_bounded_time(tmp_path):
    # A version published while a rejoining server loaded is loaded under the lock; when that
    # load hung, every publish waited out update_timeout_s (600 s by default).
    async def scenario():
        engine = _SlowThenHangingLoads()
        servers = await start_servers(tmp_path, [engine])
        versions = [write_checkpoint(exports_dir(tmp_path) / f"v{v}", f"v{v}") for v in (1, 2, 3)]
        pool = RolloutPool(addresses(servers), options=PoolOptions(
            rejoin_interval_s=0.1, rpc_timeout_s=1.0, update_timeout_s=30.0))
        try:
            await pool.start()
            pool.record_weights(exports_dir(tmp_path) / "base", 0)
            engine.armed = True
            pool._mark_dead(pool._servers[0], "a network blip")
            await pool.update_weights(versions[0], 1)  # no live server: recorded for the rejoin
            while engine.loads < 1:  # its rejoin loads version 1 (1 s) ...
                await asyncio.sleep(0.01)
            await pool.update_weights(versions[1], 2)  # ... while version 2 is published
            while engine.loads < 2:  # then loads version 2 under the lock, and hangs
                await asyncio.sleep(0.01)
            start = time.monotonic()
            await pool.update_weights(versions[2], 3)
            return time.monotonic() - start
        finally:
            await pool.close()
            for s in servers:
                await s.stop(grace=0.5)

    waited = asyncio.run(scenario())
    assert waited < 4.0  # max(rpc_timeout_s 1, 3 x the first load's 1 s), not 30 s


@pytest.mark.parametrize("stopped", ["in_a_step", "in_a_step_twice", "waiting_for_a_batch"])
def test_a_stop_checkpoints_the_versions_trained_since_the_last_checkpoint(tmp_path, stopped):
    # A stop (SIGTERM, Ctrl-C: the loop's task cancelled) wrote no checkpoint: the versions
    # trained since the last one were trained again after the resume; one in a step left it
    # running on its thread, unrecorded. Cancelled again as it stops (a server that keeps
    # exiting, then SIGTERM), it dropped that checkpoint.
    prompts = items(80)
    # A checkpoint every 2 versions; with a bound of 0, no batch is ready as a step ends: the
    # loop waits for one at every version.
    cfg = config(tmp_path, {"max_staleness": 0 if stopped == "waiting_for_a_batch" else 1})
    if stopped.startswith("in_a_step"):  # cancelled as the step to version 3 runs
        trainer, engine = RecordingTrainer(exports_dir(tmp_path), train_s=0.3), 0.005
        train, third = trainer.train_on_batch, threading.Event()

        def training(groups):
            if trainer.version == 2:
                third.set()
            return train(groups)

        trainer.train_on_batch = training

        async def during(loop, pool, servers):
            while not third.is_set():
                await asyncio.sleep(0.005)
            loop.task.cancel()
            if stopped == "in_a_step_twice":
                await asyncio.sleep(0.1)
                loop.task.cancel()
    else:  # cancelled as the loop waits for a batch at version 3 (not checkpointed yet)
        trainer, engine, during = RecordingTrainer(exports_dir(tmp_path)), 0.005, None
        idle = trainer.idle

        @contextlib.contextmanager
        def stopped_while_idle():
            with idle():
                if trainer.version == 3:
                    asyncio.current_task().cancel()
                yield

        trainer.idle = stopped_while_idle

    with pytest.raises(asyncio.CancelledError):
        run_on_servers(tmp_path, [ArithmeticEngine(step_s=engine)], cfg, trainer, prompts, 6,
                       during=during)
    assert [version for version, _ in trainer.saved] == [2, 3]
    state = trainer.saved[-1][1]
    assert state["version"] == 3
    events = read_ledger(tmp_path / "ledger.jsonl")
    assert sorted({e["version"] for e in events if e["event"] == "train"}) == [1, 2, 3]

    resumed = RecordingTrainer(exports_dir(tmp_path), version=3)
    loop = run_on_servers(tmp_path, [ArithmeticEngine(step_s=0.005)], cfg, resumed, prompts, 6,
                          state=state)
    assert [version for version, _ in resumed.batches] == [3, 4, 5]  # none trained again
    assert_nothing_lost(tmp_path / "ledger.jsonl", prompts)
    assert len(loop.metrics) == 3
