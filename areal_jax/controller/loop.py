"""The asynchronous RL loop: submission driven by completions under the staleness gate, batches
of the oldest finished groups, the train step in a worker thread, publishing in the background.

Generation never waits for the trainer: every finished group, and every version the servers
confirm, refills the gate's free slots at once — while the trainer trains or checkpoints, and
while a version is being exported and delivered. The gate counts from the version the servers
serve, so a publish still in flight tightens the bound instead of breaking it. An evaluation
inside the loop (``eval.every_steps``) runs beside training: the servers keep the evaluated
version until it ends (publishing is held), the trainer trains on what they generate with it
meanwhile, within the same bound, and its row is logged when it ends (``on_evaluated``).

Nothing accepted is lost: groups in flight or buffered when a checkpoint is written are recorded
by prompt id and resubmitted first after a restart (a stop checkpoints what was trained since
the last checkpoint, so nothing trained is trained again either); groups of a failed server are
resubmitted elsewhere by the pool; an over-stale group dropped at batch formation
(``schedule.overstale: drop``) has its prompt generated again. Only a request a server rejects
as invalid is not retried, nor one whose answer is too long to train on (a trajectory over the
micro-batch token budget: a multi-turn workflow's, say); many in a row stop the run with the
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import sys
import time
from collections.abc import Callable

import numpy as np

from areal_jax.compilation import CompileMeter
from areal_jax.controller.busy import BusyWindow
from areal_jax.controller.gate import StalenessGate
from areal_jax.controller.ledger import RunLedger
from areal_jax.controller.publisher import Publisher
from areal_jax.controller.requests import rollout_request
from areal_jax.controller.reward_watch import RewardWatch
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.data.dataset import PromptItem
from areal_jax.data.sampler import PromptIterator
from areal_jax.experiment import ExperimentConfig
from areal_jax.protocol import group_from_proto
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.repeated_warnings import RepeatedWarnings

log = logging.getLogger(__name__)


def _naming_its_field(err) -> str:
    """A request error's message, led by its field (most messages already are)."""
    field = err.field or "request"
    return err.message if err.message.startswith(f"{field}: ") else f"{field}: {err.message}"


class RolloutRejectedError(RuntimeError):
    """Too many consecutive groups were rejected (by the rollout servers as invalid, or as too
    long to train on)."""


@dataclasses.dataclass(order=True)
class _Finished:
    index: int  # submission order: batches are formed oldest first
    item: PromptItem = dataclasses.field(compare=False)
    group: object = dataclasses.field(compare=False)
    oldest: int = dataclasses.field(compare=False, default=0)  # its oldest generated token's

    @classmethod
    def of(cls, index: int, item: PromptItem, group) -> _Finished:
        """Tokens a workflow inserted (mask 0) carry no version (``-1``) and do not count."""
        generated = [v for t in group.trajectories if (v := _generated_versions(t)).size]
        oldest = min((int(v.min()) for v in generated), default=sys.maxsize)
        return cls(index, item, group, oldest)


class RLLoop:
    """Drives one RL run; ``trainer`` is an ``areal_jax.trainer.Trainer`` (or a group of them
    across processes): ``version``, ``train_on_batch(groups)``, ``snapshot_for_publish()`` and
    ``idle()`` (a context for the time the loop waits for a batch)."""

    def __init__(self, cfg: ExperimentConfig, trainer, pool: RolloutPool,
                 prompts: PromptIterator, items_by_id: dict[str, PromptItem],
                 on_step: Callable[[int, dict], None],
                 on_eval: Callable[[int], object] | None = None,
                 ledger: RunLedger | None = None,
                 on_evaluated: Callable[[int, dict], None] | None = None):
        self.cfg = cfg
        self.trainer = trainer
        self.pool = pool
        self.prompts = prompts
        self.items_by_id = items_by_id
        self.on_step = on_step
        self.on_eval = on_eval
        self.on_evaluated = on_evaluated
        self.ledger = ledger
        s = cfg.schedule
        self.gate = StalenessGate(s.batch_size, s.max_staleness, s.max_in_flight)
        self.version = trainer.version
        self.gate.restore(self.version)
        self._next_index = 0
        self._in_flight: dict[int, PromptItem] = {}
        self._buffer: list[_Finished] = []
        self._retry: list[PromptItem] = []
        self._wake = asyncio.Event()
        self._rejected = self._consecutive_rejected = self._dropped = 0
        self._rejections = RepeatedWarnings(log)  # the first of each field's, then counts
        self._fatal: BaseException | None = None
        self._paused = False
        self._ended = False  # set once run() stops training: no more prompts are submitted
        self._publisher: Publisher | None = None
        self._taken: list[_Finished] | None = None  # the batch of the step in progress
        self._step: asyncio.Future | None = None  # that step, until trained and recorded
        self._unlogged: tuple[int, dict] | None = None  # a trained version's metrics row
        self._saving: tuple[int, asyncio.Future] | None = None  # the last checkpoint write
        self._saved = 0  # the newest checkpoint's version
        self._evaluation: asyncio.Task | None = None  # of a served version, publishing held
        self._busy = BusyWindow()
        self._compiles = CompileMeter()
        self._rewards = RewardWatch(cfg.dataset.reward, advantage=cfg.trainer.advantage)

    # ---- state that survives a restart -------------------------------------------------
    def pending_ids(self) -> list[str]:
        """Prompt ids accepted but not trained yet: taken for a step that has not trained,
        buffered, in flight, waiting to be resent."""
        return ([f.item.id for f in self._taken or ()]
                + [f.item.id for f in sorted(self._buffer)]
                + [item.id for _, item in sorted(self._in_flight.items())]
                + [i.id for i in self._retry])

    def state_dict(self) -> dict:
        return {"data": self.prompts.state_dict(), "pending": self.pending_ids(),
                "version": self.version, "rejected_groups": self._rejected,
                "next_request": self._next_index}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["data"])
        pending = state.get("pending", [])
        self._retry = [self.items_by_id[i] for i in pending if i in self.items_by_id]
        self._rejected = int(state.get("rejected_groups", state.get("failed_groups", 0)))
        # Request ids and sampling seeds go on where the checkpoint left them, as they would
        # have without the restart (checkpoints from before this key start over at 0).
        self._next_index = int(state.get("next_request", 0))
        # Re-submitted groups are charged to the gate when they are sent again.
        self.gate.restore(self.version)

    # ---- submission --------------------------------------------------------------------
    @property
    def served_version(self) -> int:
        """The version the rollout servers confirmed serving: what the gate counts from."""
        return self._publisher.published if self._publisher is not None else self.version

    def _next_item(self) -> PromptItem:
        return self._retry.pop(0) if self._retry else next(self.prompts)

    def _fill(self) -> None:
        """Submit while the gate has room; called whenever room may have appeared."""
        sp = self.cfg.sampling
        while (not self._paused and not self._ended and self._fatal is None
               and self.gate.can_submit(self.served_version)):
            item = self._next_item()
            index = self._next_index
            self._next_index += 1
            rid = _request_id(index, item)
            request = rollout_request(item, rid, self.cfg.dataset.reward,
                                      sp.group_size, sp.max_new_tokens, sp.temperature,
                                      sp.top_p, sp.top_k, seed=self.cfg.seed * 1_000_003 + index)
            if self.ledger is not None:  # first: a request the ledger cannot record is not sent
                try:
                    self.ledger.record("submit", request=rid, prompt=item.id,
                                       version=self.served_version)
                except BaseException:
                    self._retry.insert(0, item)  # kept for the checkpoint
                    raise
            future = self.pool.submit(request)
            self.gate.on_submit()
            self._in_flight[index] = item
            future.add_done_callback(lambda f, i=index: self._on_done(i, f))

    def _on_done(self, index: int, future: asyncio.Future) -> None:
        item = self._in_flight.pop(index, None)
        if future.cancelled() or item is None:
            return
        try:
            self._settle(index, item, future)
            self._fill()
        except Exception as e:  # noqa: BLE001 - raised in a callback, it would vanish: the group
            # would be neither buffered nor pending and the loop would wait for it forever
            log.exception("handling the rollout of prompt %s failed", item.id)
            if item not in self._retry and all(f.item is not item for f in self._buffer):
                self._retry.insert(0, item)  # kept for the checkpoint
            self._fatal = self._fatal or e
        self._wake.set()

    def _settle(self, index: int, item: PromptItem, future: asyncio.Future) -> None:
        """Account for a finished request: buffer its group, or count its failure."""
        error = future.exception()
        if error is not None:
            self.gate.on_failed()
            self._retry.insert(0, item)  # kept for the checkpoint; the run stops
            self._fatal = error
        elif future.result().HasField("error"):
            self._on_rejected(item, future.result().error)
        elif (error := self._too_long(future.result())) is not None:
            self._on_rejected(item, error)
        else:
            self._consecutive_rejected = 0
            self.gate.on_finished()
            self._buffer.append(_Finished.of(index, item, future.result()))

    def _too_long(self, group: pb.TrajectoryGroup) -> pb.RequestError | None:
        """Why ``group`` cannot be trained, if a trajectory has more tokens than a micro-batch
        holds (its step would fail)."""
        budget = self.cfg.trainer.micro_batch.token_budget
        longest = len(group.prompt_ids) + max(len(t.output_ids) for t in group.trajectories)
        if longest <= budget:
            return None
        return pb.RequestError(field="trajectories", message=(
            f"a trajectory of {longest} tokens (prompt and answer) is over "
            f"trainer.micro_batch.token_budget ({budget}): the workflow's answers must fit one "
            "micro-batch; raise the budget or bound the answers"))

    def _on_rejected(self, item: PromptItem, err) -> None:
        self.gate.on_failed()
        self._rejected += 1
        self._consecutive_rejected += 1
        reason = re.sub(r"\d+", "N", err.message)  # one kind whatever its sizes and ids
        self._rejections.warn(f"rejected prompts (field {err.field or '-'}: {reason})",
                              "prompt %s rejected: %s (field %s)", item.id, err.message,
                              err.field or "-")
        if self.ledger is not None:
            self.ledger.record("reject", prompt=item.id, field=err.field, message=err.message)
        limit = self.cfg.rollout.max_consecutive_rejections
        if self._consecutive_rejected >= limit:
            self._fatal = RolloutRejectedError(
                f"{self._consecutive_rejected} groups in a row were rejected, by the rollout "
                f"servers or as too long to train on (rollout.max_consecutive_rejections = "
                f"{limit}); the last one: {_naming_its_field(err)}")

    # ---- batches -------------------------------------------------------------------------
    def _drop_overstale(self) -> None:
        """Discard buffered groups older than the bound allows; their prompts go again."""
        eta = self.cfg.schedule.max_staleness
        keep = []
        for f in self._buffer:
            if self.version - f.oldest > eta:
                self.gate.on_dropped()
                self._retry.append(f.item)
                self._dropped += 1
                if self.ledger is not None:
                    self.ledger.record("drop", prompt=f.item.id, version=self.version,
                                       oldest=f.oldest)
            else:
                keep.append(f)
        if len(keep) != len(self._buffer):
            self._buffer = keep
            self._fill()

    def _take_batch(self) -> list[_Finished] | None:
        if self.cfg.schedule.overstale == "drop":
            self._drop_overstale()
        B = self.cfg.schedule.batch_size
        if len(self._buffer) < B:
            return None
        self._buffer.sort()
        batch, self._buffer = self._buffer[:B], self._buffer[B:]
        return batch

    def _ready_batch(self) -> list[_Finished] | None:
        if self._fatal is not None:
            raise self._fatal
        self._publisher.raise_error()
        return self._take_batch()

    async def _next_batch(self) -> list[_Finished]:
        batch = self._ready_batch()
        if batch is not None:
            return batch
        with self.trainer.idle():  # the trainer waits: it may compile ahead meanwhile
            while (batch := self._ready_batch()) is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except TimeoutError:
                    pass
        return batch

    # ---- the loop ----------------------------------------------------------------------
    def _train(self, groups):
        metrics = self.trainer.train_on_batch(groups)
        return metrics, self.trainer.snapshot_for_publish()

    async def run(self, total_steps: int, checkpoint: Callable[[dict], None]) -> None:
        """Train until the trainer reaches ``total_steps`` versions; the last version is
        published when this returns. Cancelled (a stop, or a server that keeps exiting), it
        checkpoints what it trained since the last checkpoint first (``_checkpoint_at_stop``)."""
        self._fatal, self._ended = None, False
        sync = self.cfg.schedule.mode == "sync"
        every_ckpt, every_eval = self.cfg.checkpoint_every, self.cfg.eval.every_steps
        push = self.cfg.rollout.weights_transport == "push"
        self._publisher = Publisher(self.pool, self.version, push,
                                    on_published=lambda v, t: self._fill())
        self._busy_fractions()
        self._saved = self.version  # the newest checkpoint's version (or the start's)
        if self.ledger is not None:  # what the run stands on: the ledger voids what came after
            self.ledger.record("start", version=self.version, rejected=self._rejected)
        try:
            if self.version < total_steps:  # a finished run started again asks for nothing
                self._fill()
            while self.version < total_steps:
                wait_start = time.monotonic()
                batch = self._taken = await self._next_batch()
                if sync:
                    self._paused = True
                    await self.pool.pause()
                # Shielded: a stop waits for the step and its records (_checkpoint_at_stop).
                self._step = asyncio.ensure_future(
                    self._train_step(batch, total_steps, wait_start))
                metrics, snapshot, groups, wait_s, train_s = await asyncio.shield(self._step)
                self._step = None
                if sync:
                    await self._publisher.publish_now(snapshot)
                    self._paused = False
                    await self.pool.resume()
                    self._fill()
                else:
                    self._publisher.submit(snapshot)
                metrics.update(self._loop_metrics(groups, wait_s, train_s))
                self.on_step(self.version, metrics)
                self._unlogged = None
                if every_eval and self.version % every_eval == 0 and self.on_eval is not None:
                    await self._start_evaluation()
                    if sync:  # the synchronous baseline: nothing goes on beside it
                        await self._finish_evaluation()
                if every_ckpt and (self.version % every_ckpt == 0 or self.version == total_steps):
                    await self._checkpoint(checkpoint)
            self._end_submissions()
            await self._finish_evaluation()
            await self._publisher.flush()
            if self.ledger is not None:
                self.ledger.record("end", version=self.version, pending=self.pending_ids(),
                                   data=self.prompts.state_dict())
        except asyncio.CancelledError:
            if every_ckpt:  # to its end, whatever cancels this task again meanwhile
                stopping = asyncio.ensure_future(self._checkpoint_at_stop(checkpoint))
                while not stopping.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(stopping)
            raise
        finally:
            self._ended = True
            self._rejections.flush()
            if self._evaluation is not None:  # a stop: that evaluation is not recorded
                self._evaluation.cancel()
                await asyncio.gather(self._evaluation, return_exceptions=True)
            await self._publisher.close()

    async def _start_evaluation(self) -> None:
        """Evaluate the version just trained beside the next steps: after the one before ends
        and this version is served; publishing is held until it ends."""
        await self._finish_evaluation()
        await self._publisher.flush()
        self._publisher.hold()
        self._evaluation = asyncio.ensure_future(self.on_eval(self.version))
        self._evaluation.add_done_callback(functools.partial(self._on_evaluated, self.version))

    def _on_evaluated(self, version: int, task: asyncio.Task) -> None:
        self._publisher.release()
        if task.cancelled():
            return
        if task.exception() is not None:  # the run stops with it, at the next batch
            self._fatal = self._fatal or task.exception()
            self._wake.set()
        elif self.on_evaluated is not None:
            try:
                self.on_evaluated(version, task.result())
            except Exception as e:  # noqa: BLE001 - raised in a callback it would vanish
                self._fatal = self._fatal or e
                self._wake.set()

    async def _finish_evaluation(self) -> None:
        """Wait for the evaluation in progress, if any; raise its error."""
        if self._evaluation is not None:
            await asyncio.wait({self._evaluation})  # cancelled here, run() cancels it
            self._evaluation = None
            if self._fatal is not None:
                raise self._fatal

    async def _train_step(self, batch: list[_Finished], total_steps: int, wait_start: float):
        """Train on ``batch`` and record it (version, ledger, the metrics row to log); returns
        the row so far, the snapshot to publish, the groups, and the seconds waited for the
        batch (since ``wait_start``) and trained."""
        groups = [group_from_proto(f.group) for f in batch]
        metrics = _staleness_metrics(groups, self.version, self.cfg.schedule.max_staleness)
        metrics.update(self._rewards.observe(groups))
        t0 = time.monotonic()
        step_metrics, snapshot = await asyncio.to_thread(self._train, groups)
        wait_s, train_s = t0 - wait_start, time.monotonic() - t0
        metrics.update(step_metrics)
        self.version = self.trainer.version
        self._taken = None
        if self.version >= total_steps:  # before the last evaluation and checkpoint
            self._end_submissions()
        if self.ledger is not None:
            self.ledger.record("train", version=self.version, prompts=[f.item.id for f in batch])
        self._unlogged = (self.version, metrics)
        return metrics, snapshot, groups, wait_s, train_s

    async def _checkpoint(self, checkpoint: Callable[[dict], None]) -> None:
        """Checkpoint the trainer and this loop's state; shielded: a stop waits for the write."""
        self._saving = (self.version, asyncio.ensure_future(
            asyncio.to_thread(checkpoint, self.state_dict())))
        await asyncio.shield(self._saving[1])
        self._saved = self._saving[0]

    async def _checkpoint_at_stop(self, checkpoint: Callable[[dict], None]) -> None:
        """After a cancellation: let the checkpoint write and the step in flight finish (the
        step recorded, its metrics row logged), then checkpoint the versions trained since the
        last checkpoint, so that the resumed run does not train them again. A failure here is
        logged; the stop goes on."""
        try:
            if self._saving is not None:  # done, or still writing
                await self._saving[1]
                self._saved = self._saving[0]
            if self._step is not None:
                await self._step
                self._step = None
            if self._unlogged is not None:
                self.on_step(*self._unlogged)
                self._unlogged = None
            if self.version > self._saved:
                log.warning("stopping: checkpointing version %d (the last checkpoint was of "
                            "version %d)", self.version, self._saved)
                await asyncio.to_thread(checkpoint, self.state_dict())
                self._saved = self.version
        except Exception:  # noqa: BLE001 - the stop goes on; said, with what the resume does
            log.exception("stopping: the step or checkpoint in progress failed; the run "
                          "resumes from its newest checkpoint (version %d)", self._saved)

    def _end_submissions(self) -> None:
        """The last version is trained: ask for nothing more, and take back the groups still
        generating. The servers stop on them (the evaluation after RL has the servers to
        itself) and they stay pending, sent again if the run goes on."""
        self._ended = True
        withdrawn = sorted(self._in_flight.items())
        self._in_flight.clear()
        self._retry[:0] = [item for _, item in withdrawn]
        for _ in withdrawn:
            self.gate.on_failed()
        self.pool.withdraw([_request_id(index, item) for index, item in withdrawn])

    def _busy_fractions(self) -> dict[str, float]:
        """Per server, its busy fraction since the last call (see ``controller.busy``)."""
        share = self.cfg.schedule.max_in_flight / max(1, len(self.pool.live_servers))
        return self._busy.fractions(self.pool.busy_clocks(), share)

    def _loop_metrics(self, groups, wait_s: float, train_s: float) -> dict[str, float]:
        gen_s = [g.metadata["timing"]["generation_s"] for g in groups]
        busy = self._busy_fractions()
        live = set(self.pool.live_servers)
        out = {"rollout/generation_s": float(np.mean(gen_s)),
               "timing/train_s": train_s, "timing/wait_s": wait_s,
               "version": float(self.version),
               "version/served": float(self.served_version),
               "version/publish_lag": float(self.version - self.served_version),
               "rollout/in_flight": float(self.gate.in_flight),
               "rollout/buffered": float(len(self._buffer)),
               "rollout/rejected_groups": float(self._rejected),
               "rollout/dropped_overstale": float(self._dropped),
               "rollout/resubmitted": float(self.pool.resubmitted),
               "rollout/live_servers": float(len(live))}
        out.update(self._publisher.last_timings)
        here, ahead = self._compiles.take(), self._compiles.take_ahead()
        out.update({"timing/compile_s": here.seconds, "compile/programs": float(here.programs),
                    "compile/loaded": float(here.loaded),
                    "timing/compile_ahead_s": ahead.seconds,
                    "compile/ahead_programs": float(ahead.programs)})
        if here.programs and self.version > 3:
            log.info("version %d compiled %d new programs (%.1f s, %d more loaded from the "
                     "cache)", self.version, here.programs, here.seconds, here.loaded)
        for i, (address, fraction) in enumerate(busy.items()):
            out[f"rollout/busy_fraction/server{i}"] = fraction
        live_busy = [f for a, f in busy.items() if a in live]
        if live_busy:
            out["rollout/busy_fraction"] = float(min(live_busy))
        return out


def _request_id(index: int, item: PromptItem) -> str:
    """The id of the ``index``-th request of the run, for ``item``."""
    return f"{index}:{item.id}"


def _generated_versions(t) -> np.ndarray:
    """Versions of a trajectory's generated tokens (an empty mask on the wire means all)."""
    versions, mask = np.asarray(t.versions), np.asarray(t.output_mask)
    return versions if mask.size == 0 else versions[mask == 1]


def _staleness_metrics(groups, version: int, bound: int) -> dict[str, float]:
    """Distribution of the per-token staleness (``version`` minus the token's) trained on."""
    stale = np.concatenate([version - _generated_versions(t)
                            for g in groups for t in g.trajectories])
    return {"staleness/p50": float(np.percentile(stale, 50)),
            "staleness/p90": float(np.percentile(stale, 90)),
            "staleness/over_bound_fraction": float(np.mean(stale > bound))}
