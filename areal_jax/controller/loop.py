"""The asynchronous RL loop: submit under the staleness gate, buffer finished groups, train on
the oldest ``batch_size`` groups in a worker thread (streams keep flowing), publish each new
version to every rollout server.

Nothing accepted is lost: groups in flight or buffered when a checkpoint is written are
recorded by prompt id and resubmitted first after a restart; groups of a failed server are
resubmitted elsewhere by the pool, keeping their gate slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from areal_jax.controller.gate import StalenessGate
from areal_jax.controller.requests import rollout_request
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.data.dataset import PromptItem
from areal_jax.data.sampler import PromptIterator
from areal_jax.experiment import ExperimentConfig
from areal_jax.protocol import group_from_proto

log = logging.getLogger(__name__)


@dataclasses.dataclass(order=True)
class _Finished:
    index: int  # submission order: batches are formed oldest first
    item: PromptItem = dataclasses.field(compare=False)
    group: object = dataclasses.field(compare=False)


class RLLoop:
    """Drives one RL run; ``trainer`` is an ``areal_jax.trainer.Trainer``."""

    def __init__(self, cfg: ExperimentConfig, trainer, pool: RolloutPool,
                 prompts: PromptIterator, items_by_id: dict[str, PromptItem],
                 on_step: Callable[[int, dict], None], on_eval: Callable[[int], object] | None = None):
        self.cfg = cfg
        self.trainer = trainer
        self.pool = pool
        self.prompts = prompts
        self.items_by_id = items_by_id
        self.on_step = on_step
        self.on_eval = on_eval
        s = cfg.schedule
        self.gate = StalenessGate(s.batch_size, s.max_staleness, s.max_in_flight)
        self.version = trainer.version
        self.gate.restore(self.version)
        self._next_index = 0
        self._in_flight: dict[int, PromptItem] = {}
        self._buffer: list[_Finished] = []
        self._retry: list[PromptItem] = []
        self._wake = asyncio.Event()
        self._failed_groups = 0
        self._paused = False

    # ---- state that survives a restart -------------------------------------------------
    def state_dict(self) -> dict:
        pending = [f.item.id for f in sorted(self._buffer)] + [
            item.id for _, item in sorted(self._in_flight.items())]
        return {"data": self.prompts.state_dict(), "pending": pending + [i.id for i in self._retry],
                "version": self.version, "failed_groups": self._failed_groups}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["data"])
        self._retry = [self.items_by_id[i] for i in state.get("pending", []) if i in self.items_by_id]
        self._failed_groups = int(state.get("failed_groups", 0))
        # Re-submitted groups are charged to the gate when they are sent again.
        self.gate.restore(self.version)

    # ---- submission --------------------------------------------------------------------
    def _next_item(self) -> PromptItem:
        return self._retry.pop(0) if self._retry else next(self.prompts)

    def _submit_allowed(self) -> None:
        sp = self.cfg.sampling
        while not self._paused and self.gate.can_submit(self.version):
            item = self._next_item()
            index = self._next_index
            self._next_index += 1
            request = rollout_request(item, f"{index}:{item.id}", self.cfg.dataset.reward,
                                      sp.group_size, sp.max_new_tokens, sp.temperature,
                                      sp.top_p, sp.top_k, seed=self.cfg.seed * 1_000_003 + index)
            future = self.pool.submit(request)
            self.gate.on_submit()
            self._in_flight[index] = item
            future.add_done_callback(lambda f, i=index: self._on_done(i, f))

    def _on_done(self, index: int, future: asyncio.Future) -> None:
        item = self._in_flight.pop(index, None)
        if future.cancelled() or item is None:
            return
        error = future.exception()
        if error is not None:
            self.gate.on_failed()
            self._fatal = error
        elif future.result().HasField("error"):
            err = future.result().error
            log.warning("prompt %s rejected by the rollout server: %s (%s)", item.id,
                        err.message, err.field)
            self.gate.on_failed()
            self._failed_groups += 1
        else:
            self.gate.on_finished()
            self._buffer.append(_Finished(index, item, future.result()))
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------
    async def run(self, total_steps: int, checkpoint: Callable[[dict], None]) -> None:
        """Train until the trainer reaches ``total_steps`` versions."""
        self._fatal = None
        B = self.cfg.schedule.batch_size
        sync = self.cfg.schedule.mode == "sync"
        every_ckpt = self.cfg.checkpoint_every
        every_eval = self.cfg.eval.every_steps
        while self.version < total_steps:
            self._submit_allowed()
            if self._fatal is not None:
                raise self._fatal
            if len(self._buffer) < B:
                self._wake.clear()
                await self._wake.wait()
                continue
            wait_end = time.monotonic()
            self._buffer.sort()
            batch, self._buffer = self._buffer[:B], self._buffer[B:]
            if sync:
                self._paused = True
                await self.pool.pause()
            groups = [group_from_proto(f.group) for f in batch]
            t0 = time.monotonic()
            metrics = await asyncio.to_thread(self.trainer.train_on_batch, groups)
            t1 = time.monotonic()
            self.version = self.trainer.version
            path = await asyncio.to_thread(self.trainer.publish, self.version)
            await self.pool.update_weights(path, self.version,
                                           push=self.cfg.rollout.weights_transport == "push")
            t2 = time.monotonic()
            if sync:
                self._paused = False
                await self.pool.resume()
            metrics.update(self._rollout_metrics(groups))
            metrics.update({"timing/train_s": t1 - t0, "timing/publish_s": t2 - t1,
                            "timing/wait_s": t0 - wait_end, "version": float(self.version),
                            "rollout/in_flight": float(self.gate.in_flight),
                            "rollout/buffered": float(len(self._buffer)),
                            "rollout/failed_groups": float(self._failed_groups)})
            if every_eval and self.version % every_eval == 0 and self.on_eval is not None:
                metrics.update(await self.on_eval(self.version))
            self.on_step(self.version, metrics)
            if every_ckpt and (self.version % every_ckpt == 0 or self.version == total_steps):
                await asyncio.to_thread(checkpoint, self.state_dict())

    @staticmethod
    def _rollout_metrics(groups) -> dict[str, float]:
        rewards = [t.reward for g in groups for t in g.trajectories]
        lengths = [len(t.output_ids) for g in groups for t in g.trajectories]
        gen_s = [g.metadata["timing"]["generation_s"] for g in groups]
        return {"reward/mean": float(np.mean(rewards)),
                "response_length/mean": float(np.mean(lengths)),
                "response_length/max": float(np.max(lengths)),
                "rollout/generation_s": float(np.mean(gen_s))}
