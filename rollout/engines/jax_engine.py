"""The JAX generation engine: continuous batching, on-device sampling, interruptible weight swap.

This module is the asyncio face of the engine (``GenerationEngine``); the device work runs on
the worker thread of ``jax_worker``, the device programs live in ``jax_decode`` and sampling in
``jax_sampling``. Runs on one device (the first JAX device) on CPU, GPU or TPU.
``docs/jax-engine.md`` describes the options and the guarantees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.config import ConfigError, from_dict
from areal_jax.models import ModelConfig, ModelConfigError
from areal_jax.models.config import generation_eos_ids
from rollout.config import EngineConfig
from rollout.engine import (
    EngineError,
    GenerationChunk,
    GenerationEngine,
    SamplingParams,
)
from rollout.engines.jax_slots import Sequence
from rollout.engines.jax_weights import load_params, read_config
from rollout.engines.jax_worker import ABORTED, DecodeWorker
from rollout.timing import ThroughputMeter
from rollout.validation import check_prompt

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048
SMALLEST_BUCKET = 16
CPU_DECODE_STEPS, ACCELERATOR_DECODE_STEPS = 8, 32  # decode_steps_per_call when unset


@dataclasses.dataclass
class JaxEngineOptions:
    """``engine.options`` for ``engine.kind: jax``."""

    context_option: ClassVar[str] = "max_seq_len"

    num_slots: int = 8  # sequences decoded together
    # decode batch sizes: a call computes the smallest that holds every active slot;
    # default num_slots and its halvings down to a quarter
    batch_buckets: list[int] | None = None
    max_seq_len: int | None = None  # cache length = max prompt + output; default min(model, 2048)
    prefill_buckets: list[int] | None = None  # prompt paddings; default powers of two from 16
    # decode steps inside one device call; null: 8 on a CPU, 32 on an accelerator (where a
    # call's host round trip is a large share of a step: 25-28% more tokens/s at 0.5B)
    decode_steps_per_call: int | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 on CPU, else bfloat16
    seed: int = 0  # draws the seeds of requests that bring none
    swap_mode: Literal["interrupt", "keep_cache", "drain"] = "interrupt"
    # compile every prefill and decode program at start (before the engine takes requests),
    # so no request waits for a compile in the middle of serving; off: each compiles when
    # first needed (either way they go to the persistent compilation cache)
    precompile: bool = False
    # programs ``precompile`` compiles at once (each compile releases the GIL); null: one per
    # CPU this process may use
    compile_threads: int | None = None

    def __post_init__(self):
        for name in ("num_slots", "decode_steps_per_call", "compile_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"engine.options.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"engine.options.max_seq_len: must be >= 2, got {self.max_seq_len}")
        if self.prefill_buckets is not None:
            if not self.prefill_buckets:
                raise ConfigError("engine.options.prefill_buckets: must not be empty")
            for i, b in enumerate(self.prefill_buckets):
                if b < 1:
                    raise ConfigError(f"engine.options.prefill_buckets[{i}]: must be >= 1, got {b}")
        if self.batch_buckets is not None:
            if not self.batch_buckets:
                raise ConfigError("engine.options.batch_buckets: must not be empty")
            for i, b in enumerate(self.batch_buckets):
                if not 1 <= b <= self.num_slots:
                    raise ConfigError(f"engine.options.batch_buckets[{i}]: must be in "
                                      f"[1, num_slots={self.num_slots}], got {b}")
        if self.seed < 0:
            raise ConfigError(f"engine.options.seed: must be >= 0, got {self.seed}")

    def served_context(self, positions: int) -> int:
        """``max_seq_len``, by default the model's ``positions`` up to ``DEFAULT_MAX_SEQ_LEN``;
        ``ConfigError`` beyond ``positions``."""
        max_len = self.max_seq_len or min(positions, DEFAULT_MAX_SEQ_LEN)
        if max_len > positions:
            raise ConfigError(f"engine.options.max_seq_len: {max_len} exceeds the model's "
                              f"max_position_embeddings {positions}")
        return max_len

    def resolved(self, cfg: ModelConfig) -> JaxEngineOptions:
        """These options with ``max_seq_len``, the buckets, ``dtype`` and
        ``decode_steps_per_call`` made concrete.

        The prefill buckets always end with ``max_seq_len`` so that every context fits one,
        the batch buckets with ``num_slots``.
        """
        max_len = self.served_context(cfg.max_position_embeddings)
        buckets = self.prefill_buckets
        if buckets is None:
            buckets = _powers_of_two(SMALLEST_BUCKET, below=max_len)
        for i, b in enumerate(buckets):
            if b > max_len:
                raise ConfigError(
                    f"engine.options.prefill_buckets[{i}]: {b} exceeds max_seq_len {max_len}"
                )
        on_cpu = jax.default_backend() == "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if on_cpu else "bfloat16"
        steps = self.decode_steps_per_call
        if steps is None:
            steps = CPU_DECODE_STEPS if on_cpu else ACCELERATOR_DECODE_STEPS
        batch = self.batch_buckets
        if batch is None:
            batch = [max(1, self.num_slots // 4), max(1, self.num_slots // 2)]
        return dataclasses.replace(
            self, max_seq_len=max_len, prefill_buckets=sorted({*buckets, max_len}),
            batch_buckets=sorted({*batch, self.num_slots}), dtype=dtype,
            decode_steps_per_call=steps,
        )


def _powers_of_two(start: int, below: int) -> list[int]:
    out = []
    while start < below:
        out.append(start)
        start *= 2
    return out


class JaxEngine(GenerationEngine):
    """Serves one model with the JAX engine; see the module docstring."""

    kind = "jax"

    def __init__(self, options: JaxEngineOptions, cfg: ModelConfig, model_path: str, version: int,
                 generation_eos: Collection[int]):
        self.options = options.resolved(cfg)
        # Token ids play no part in the computation; without them the compiled programs are
        # shared by checkpoints that differ only there (and the config stays hashable).
        self._cfg = dataclasses.replace(
            cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None
        )
        self._model_path = model_path
        self._initial_version = version
        self._dtype = jnp.dtype(self.options.dtype)
        self._seeds = np.random.default_rng(self.options.seed)
        # config.json's end ids and generation_config.json's (``generation_eos``): transformers
        # and SGLang stop on both
        self._eos = sorted({t for t in (*cfg.eos_token_ids, *generation_eos)
                            if 0 <= t < cfg.vocab_size})
        self._worker: DecodeWorker | None = None
        self._update_lock = asyncio.Lock()
        self._closed = False
        self._meter = ThroughputMeter(window_s=30.0)

    @property
    def version(self) -> int:
        return self._worker.version if self._worker is not None else self._initial_version

    @property
    def vocab_size(self) -> int:
        return self._cfg.vocab_size

    @property
    def max_context_len(self) -> int:
        return self.options.max_seq_len

    @property
    def paused(self) -> bool:
        """The worker's own state: a pause or resume whose caller gave up before the worker
        took it never took effect."""
        return self._worker is not None and self._worker.paused

    @property
    def failure(self) -> EngineError | None:
        return self._worker.error if self._worker is not None else None

    async def start(self) -> None:
        """Load the weights and start the decode worker (compiling its programs first with
        ``precompile``). A failed start leaves the engine unstarted, to be started again; an
        engine that was shut down is not started again."""
        if self._closed:
            raise EngineError("the JAX engine was shut down; start a new one")
        if self._worker is not None:
            return
        graphdef, params = await asyncio.to_thread(
            load_params, self._model_path, self._cfg, self._dtype
        )
        o = self.options
        worker = DecodeWorker(
            graphdef, params, self._initial_version, self._cfg,
            num_slots=o.num_slots, max_seq_len=o.max_seq_len, prefill_buckets=o.prefill_buckets,
            batch_buckets=o.batch_buckets,
            decode_steps=o.decode_steps_per_call, swap_mode=o.swap_mode, dtype=self._dtype,
        )
        if o.precompile:
            log.info("JAX engine: compiling its prefill and decode programs before serving")
            began = time.perf_counter()
            calls = await asyncio.to_thread(worker.precompile, o.compile_threads)
            log.info("JAX engine: %d prefill and decode programs ready in %.1f s", calls,
                     time.perf_counter() - began)
        if self._closed:  # shut down while it loaded or compiled
            raise EngineError("the JAX engine was shut down while it started")
        worker.start()
        self._worker = worker

    def _started(self) -> DecodeWorker:
        if self._worker is None:
            raise EngineError("the JAX engine has not been started")
        return self._worker

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.vocab_size)
        check_prompt(prompt_ids, params.max_new_tokens, self.vocab_size, self.max_context_len)

    def _sequence(self, prompt_ids, params, request_id, queue: asyncio.Queue) -> Sequence:
        loop = asyncio.get_running_loop()

        def deliver(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone; nobody is listening
                pass

        stop_row = np.zeros(self.vocab_size, bool)
        stop_row[list(params.stop_token_ids) + self._eos] = True
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        return Sequence(request_id, list(prompt_ids), params, seed, stop_row, deliver)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        self._check(prompt_ids, params)
        if self._closed:  # shut down (started or not): every request ends aborted
            yield ABORTED
            return
        worker = self._started()
        queue: asyncio.Queue = asyncio.Queue()
        seq = self._sequence(prompt_ids, params, request_id, queue)
        if not worker.submit(seq):
            if worker.error is not None:
                raise worker.error
            yield ABORTED
            return
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._meter.add(len(item.token_ids))
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.done:
                worker.cancel(seq)

    async def update_weights(self, path: str, version: int) -> None:
        worker = self._started()
        async with self._update_lock:
            _, params = await asyncio.to_thread(
                load_params, path, self._cfg, self._dtype, served=self._cfg
            )
            await asyncio.wrap_future(worker.swap(params, version))

    async def pause(self) -> None:
        await asyncio.wrap_future(self._started().pause())

    async def resume(self) -> None:
        await asyncio.wrap_future(self._started().resume())

    async def shutdown(self) -> None:
        if self._closed or self._worker is None:
            self._closed = True
            return
        self._closed = True
        try:
            await asyncio.wrap_future(self._worker.close())
        except EngineError:
            pass  # the worker had already failed; its requests got the error
        await asyncio.to_thread(self._worker.join)

    def stats(self) -> dict[str, float]:
        w = self._worker
        if w is None:
            return {}
        return {
            "running_slots": w.running,
            "queued_requests": w.queued,
            "tokens_generated": self._meter.total,
            "tokens_per_second": self._meter.rate(),
            "swaps": w.swaps,
            "reprefills": w.reprefills,
            "prefill_calls": w.prefill_calls,
            "prefill_seconds": w.prefill_seconds,
            "decode_calls": w.decode_calls,
            "decode_rows": w.decode_rows,
        }


OPTIONS = JaxEngineOptions  # the dataclass of engine.options


def build_engine(config: EngineConfig) -> JaxEngine:
    """The JAX engine for ``config``; bad options raise ``ConfigError`` naming the key."""
    options = from_dict(OPTIONS, config.options, prefix="engine.options")
    try:
        cfg = read_config(config.model_path)
        eos = generation_eos_ids(config.model_path, cfg.vocab_size)
    except (EngineError, ModelConfigError) as e:
        raise ConfigError(f"engine.model_path: {e}") from e
    return JaxEngine(options, cfg, config.model_path, config.initial_version, eos)
