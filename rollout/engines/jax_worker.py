"""The JAX engine's worker thread: continuous batching over fixed slots, and the weight swap.

The worker owns everything on the device (parameters, their per-layer split that decode
reads, the KV cache as one buffer per layer, stop masks) and is the only
thread that calls the device programs, so the event loop never blocks on device work. It loops:
run control commands, drop cancelled requests, swap weights when due, move queued requests
into free slots, prefill every slot that needs it (newly admitted, or invalidated by a swap)
with their contexts packed into as few calls as the largest bucket allows (each call's
contexts in the narrowest rows that hold them: attention stays within a row), then run decode
calls of several steps, each computing the smallest batch bucket of slots that holds every
active one and attending over the smallest bucket of cache entries that holds every
sequence. The first decode call is dispatched right behind the prefill, from the slot state
the prefill left on the device, and while nothing on the host needs a turn each next decode
call is dispatched before the previous one's tokens are read back: the host reads and
delivers while the device computes. Chunks go back to each request through its ``deliver``
callback.

Weight swap: new parameters arrive already loaded on the device. In ``interrupt`` mode they
replace the old ones at once; every running sequence is then re-prefilled (prompt + tokens so
far) with the new weights and continues. In ``keep_cache`` mode they replace the old ones at
once and running sequences continue on their KV cache as the old weights computed it. In
``drain`` mode admission stops until the running sequences finish, then the swap happens.
While paused no token is produced, so every mode swaps at once (``interrupt`` and ``drain``
re-prefill running sequences on resume).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.models import KVCache, ModelConfig
from areal_jax.rl import packing
from rollout.engine import EngineError, GenerationChunk, WeightLoadError
from rollout.engines import jax_decode
from rollout.engines.jax_slots import Sequence, SlotTable

log = logging.getLogger(__name__)

ABORTED = GenerationChunk((), (), (), "abort")


ROWS_PER_LAYOUT = (1, 4, 16)  # a prefill of total length T runs as 1, 4 or 16 rows of T / n


def prefill_layouts(buckets: list[int]) -> dict[int, list[int]]:
    """The row widths a prefill of each total length (a bucket) may use, narrowest first: the
    buckets that cut it into ``ROWS_PER_LAYOUT`` rows. Each (total, width) is one program."""
    return {t: sorted(w for w in buckets if t % w == 0 and t // w in ROWS_PER_LAYOUT)
            for t in buckets}


@dataclasses.dataclass
class _Prefill:
    """Prefill calls dispatched and not yet read back."""

    calls: list[tuple[list[int], jax_decode.SlotArrays, tuple]]  # (slots, requests, outputs)
    state: jax_decode.SlotArrays  # every slot's decode state after them, on the device
    may_decode: np.ndarray  # [B] bool: the slots they fill that may go on decoding
    reach: int  # the longest context they fill
    seconds: float  # host time spent dispatching them


class DecodeWorker:
    """Serves sequences on ``num_slots`` slots from one thread; see the module docstring."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        version: int,
        cfg: ModelConfig,
        *,
        num_slots: int,
        max_seq_len: int,
        prefill_buckets: list[int],
        batch_buckets: list[int],
        decode_steps: int,
        swap_mode: str,
        dtype,
    ):
        self.version = version
        self.swaps = self.prefill_calls = self.decode_calls = self.reprefills = 0
        self.decode_rows = 0  # slots computed, summed over decode calls
        # host time of prefills: dispatching them, then waiting for their results (the decode
        # call queued behind them is already dispatched by then)
        self.prefill_seconds = 0.0
        self.error: EngineError | None = None
        self._graphdef, self._params = graphdef, params
        self._layers = jax_decode.split_layers(graphdef, params)
        self._buckets = sorted(prefill_buckets)
        self._layouts = prefill_layouts(self._buckets)
        self._batch_buckets = sorted(batch_buckets)
        self._steps, self._swap_mode = decode_steps, swap_mode
        # Placed like the parameters, as the programs' outputs are: inputs keep one sharding
        # from the first call on, so nothing compiles twice.
        placement = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())
        self._placement = placement
        keys = (num_slots, cfg.num_kv_heads, cfg.head_dim, max_seq_len)  # transposed
        values = (num_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self._cache = jax.device_put(  # one buffer per layer
            [KVCache(jnp.zeros(keys, dtype), jnp.zeros(values, dtype))
             for _ in range(cfg.num_layers)], placement)
        self._stop_mask = jax.device_put(jnp.zeros((num_slots, cfg.vocab_size), bool), placement)
        self._slots = SlotTable(num_slots)
        self._pending: collections.deque[Sequence] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[Future], None], Future]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._paused = self._closing = self._stopped = False
        self._swap: tuple[nnx.State, int, Future] | None = None
        self._close_future: Future | None = None
        self._thread = threading.Thread(target=self._run, name="jax-engine-worker", daemon=True)

    # Called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    @property
    def running(self) -> int:
        return self._slots.running

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def paused(self) -> bool:
        return self._paused

    def precompile(self, threads: int | None = None) -> int:
        """Compile every program serving can call (prefill per bucket and row width, decode per
        attention window and batch bucket), ``threads`` at a time (default: one per CPU this
        process may use), then run each once on empty slots, before ``start``, so no request
        waits for a compile; returns how many programs. Empty slots write no cache row that a
        request reads: a slot's row is prefilled before it decodes."""
        num_slots = len(self._slots.seqs)
        empty = SlotTable(num_slots)
        requests = empty.requests([], num_slots)
        unused, last = np.full(num_slots, num_slots, np.int32), np.zeros(num_slots, np.int32)
        stop_rows = np.zeros((num_slots, self._stop_mask.shape[1]), bool)
        state = jax.device_put(empty.arrays, self._placement)
        programs = []  # (function, its arguments before the cache and stop mask, after them)
        for total, widths in self._layouts.items():
            for width in widths:
                rows = np.zeros((total // width, width), np.int32)
                programs.append((jax_decode.prefill, (self._graphdef, self._params),
                                 (state, rows, rows, rows, unused, last, requests, stop_rows)))
        for window in self._buckets:
            for size in self._batch_buckets:
                programs.append((
                    jax_decode.decode,
                    (self._graphdef, self._steps, window, self._params, self._layers),
                    (state, np.arange(size, dtype=np.int32)),
                ))

        def compile_one(program) -> None:
            function, before, after = program
            function.lower(*before, self._cache, self._stop_mask, *after).compile()

        if threads is None:
            threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
        with ThreadPoolExecutor(min(threads, len(programs)), "jax-engine-compile") as pool:
            for _ in pool.map(compile_one, programs):  # each compile releases the GIL
                pass
        for function, before, after in programs:  # compiled: each call only runs
            outputs = function(*before, self._cache, self._stop_mask, *after)
            if function is jax_decode.prefill:
                self._cache, self._stop_mask, *outputs = outputs
            else:
                self._cache, *outputs = outputs
            jax.block_until_ready(outputs)
        return len(programs)

    def submit(self, seq: Sequence) -> bool:
        """Queue ``seq``; False if the worker has stopped (shut down or failed)."""
        with self._cond:
            if self._stopped:
                return False
            self._pending.append(seq)
            self._cond.notify()
        return True

    def cancel(self, seq: Sequence) -> None:
        """Free ``seq``'s slot (or queue place) at the next round; nothing more is delivered."""
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def pause(self) -> Future:
        """Resolves once no device call runs and none will until ``resume``."""
        return self._command(lambda fut: self._set_paused(True, fut))

    def resume(self) -> Future:
        return self._command(lambda fut: self._set_paused(False, fut))

    def swap(self, params: nnx.State, version: int) -> Future:
        """Resolves once ``params`` serve as ``version`` (in drain mode: after the drain)."""
        return self._command(lambda fut: self._request_swap(params, version, fut))

    def close(self) -> Future:
        """Abort every sequence (last chunk ``abort``) and end the thread."""
        return self._command(self._set_closing)

    def _command(self, action: Callable[[Future], None]) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                fut.set_exception(self.error or EngineError("the engine has shut down"))
            else:
                self._commands.append((action, fut))
                self._cond.notify()
        return fut

    # Worker thread ---------------------------------------------------------------------------

    def _set_paused(self, paused: bool, fut: Future) -> None:
        self._paused = paused
        self._maybe_swap()
        _settle(fut)

    def _request_swap(self, params: nnx.State, version: int, fut: Future) -> None:
        self._swap = (params, version, fut)
        self._maybe_swap()

    def _set_closing(self, fut: Future) -> None:
        self._closing = True
        self._close_future = fut

    def _run(self) -> None:
        try:
            while self._next_round():
                self._round()
        except Exception as e:  # a device call failed: every request gets the error
            log.exception("JAX engine worker failed")
            self.error = EngineError(f"JAX engine failed: {type(e).__name__}: {e}")
        finally:
            self._end()

    def _has_work(self) -> bool:
        if self._paused:  # only cancellations to drop: a paused engine makes no device call
            return any(s.cancelled for s in self._pending) or any(
                self._slots.seqs[slot].cancelled for slot in self._slots.occupied())
        if self._slots.running or self._swap is not None or any(s.cancelled for s in self._pending):
            return True
        return bool(self._pending) and bool(self._slots.free())

    def _next_round(self) -> bool:
        """Wait for work or commands, run the commands; False once closing."""
        with self._cond:
            while not (self._commands or self._has_work()):
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
        for i, (action, fut) in enumerate(commands):
            # A command whose caller gave up (a deadline cancelled its future) never takes
            # effect, except closing; one that takes effect resolves a future nobody may cancel.
            if not (fut.set_running_or_notify_cancel() or action == self._set_closing):
                continue
            try:
                action(fut)
            except BaseException:
                with self._cond:  # refused by _end, not left waiting
                    self._commands.extendleft(reversed(commands[i + 1:]))
                raise
        return not self._closing

    def _round(self) -> None:
        self._drop_cancelled()  # also while paused: requests given up on hold nothing
        if self._paused:
            return
        self._maybe_swap()
        if self._swap is None:
            self._admit()
        self._decode(self._prefill() if self._slots.unfilled.any() else None)

    def _drop_cancelled(self) -> None:
        for slot in self._slots.occupied():
            if self._slots.seqs[slot].cancelled:
                self._slots.release(slot)
        with self._cond:
            if any(s.cancelled for s in self._pending):
                self._pending = collections.deque(s for s in self._pending if not s.cancelled)

    def _maybe_swap(self) -> None:
        if self._swap is None:
            return
        if self._swap_mode == "drain" and not self._paused and self._slots.running:
            return
        params, version, fut = self._swap
        self._swap = None
        try:  # before any state changes: a failure here leaves the old weights serving
            layers = jax_decode.split_layers(self._graphdef, params)
        except Exception as e:  # noqa: BLE001 - e.g. the device ran out of memory
            log.exception("placing the weights of version %d failed", version)
            _settle(fut, error=WeightLoadError(
                f"placing the weights of version {version} on the device failed: "
                f"{type(e).__name__}: {e!s:.300}"))
            return
        self._params, self._layers, self.version = params, layers, version
        self.swaps += 1
        if self._swap_mode != "keep_cache":
            for slot in self._slots.occupied():
                self._slots.invalidate(slot)
        _settle(fut)

    def _admit(self) -> None:
        """Move queued sequences into free slots (prefilled next)."""
        with self._cond:
            for slot in self._slots.free():
                while self._pending and self._pending[0].cancelled:  # cancelled meanwhile
                    self._pending.popleft()
                if not self._pending:
                    return
                self._slots.assign(slot, self._pending.popleft())

    def _prefill(self) -> _Prefill:
        """Start prefilling every unfilled slot's context (prompt + output so far), packed
        into as few calls as the largest bucket allows; nothing is read back yet."""
        start = time.perf_counter()
        filled = np.flatnonzero(self._slots.unfilled).tolist()
        seqs = [self._slots.seqs[slot] for slot in filled]
        lengths = [len(seq.prompt) + len(seq.output) for seq in seqs]
        groups, size = [[]], 0
        for slot, n in zip(filled, lengths):
            if size + n > self._buckets[-1]:
                groups, size = groups + [[]], 0
            groups[-1].append(slot)
            size += n
        state = jax.device_put(self._slots.arrays, self._placement)
        calls = []
        for group in groups:
            state, requests, outputs = self._dispatch_prefill(group, state)
            calls.append((group, requests, outputs))
        may_decode = np.zeros_like(self._slots.unfilled)  # unless the next token is the last
        may_decode[[slot for slot, seq in zip(filled, seqs)
                    if seq.params.max_new_tokens - len(seq.output) > 1]] = True
        reach = max(lengths)
        return _Prefill(calls, state, may_decode, reach, time.perf_counter() - start)

    def _deliver_prefill(self, prefill: _Prefill) -> None:
        """Read back a prefill's sampled tokens, record them and deliver them."""
        start = time.perf_counter()
        for group, requests, outputs in prefill.calls:
            tokens, logprobs, status = jax.device_get(outputs)
            for i, slot in enumerate(group):
                seq = self._slots.seqs[slot]
                chunk = self._slots.filled(slot, i, requests, int(tokens[i]), float(logprobs[i]),
                                           int(status[i]), self.version)
                self._send(seq, chunk)
        self.prefill_seconds += prefill.seconds + time.perf_counter() - start

    def _dispatch_prefill(self, group: list[int], state: jax_decode.SlotArrays) -> tuple:
        """Start one prefill call for the slots ``group``, entering them into the device
        decode ``state``; the new state, the call's requests and its outputs."""
        seqs = [self._slots.seqs[slot] for slot in group]
        self.reprefills += sum(bool(seq.output) for seq in seqs)
        contexts = [seq.context for seq in seqs]
        width, rows = self._layout([len(c) for c in contexts])
        num_slots = len(self._slots.seqs)
        tokens, segments, positions = np.zeros((3, len(rows), width), np.int32)
        slots, last = np.full(num_slots, num_slots, np.int32), np.zeros(num_slots, np.int32)
        stop_rows = np.zeros((num_slots, seqs[0].stop_row.shape[0]), bool)
        for r, members in enumerate(rows):
            end = 0
            for i in members:
                span = slice(end, end + len(contexts[i]))
                tokens[r, span], segments[r, span] = contexts[i], i + 1
                positions[r, span] = np.arange(len(contexts[i]))
                slots[i], last[i] = group[i], r * width + span.stop - 1
                stop_rows[i] = seqs[i].stop_row
                end = span.stop
        requests = self._slots.requests(seqs, num_slots)
        self._cache, self._stop_mask, state, *outputs = jax_decode.prefill(
            self._graphdef, self._params, self._cache, self._stop_mask, state, tokens, segments,
            positions, slots, last, requests, stop_rows,
        )
        self.prefill_calls += 1
        return state, requests, outputs

    def _layout(self, lengths: list[int]) -> tuple[int, list[list[int]]]:
        """Rows for contexts of ``lengths`` (in all at most the largest bucket): the narrowest
        width of the smallest bucket holding them into which first-fit-decreasing fits them
        (same padded area, least attention); (width, the context indices of each row, empty
        rows included)."""
        total = next(b for b in self._buckets if b >= sum(lengths))
        for width in self._layouts[total]:
            if width < max(lengths):
                continue
            rows = packing.first_fit_rows(lengths, width)
            if len(rows) * width <= total:
                return width, rows + [[]] * (total // width - len(rows))
        raise AssertionError("the widest layout, one row of the total, always fits")

    def _decode(self, prefill: _Prefill | None) -> None:
        """Decode calls back to back while nothing on the host needs a turn.

        The first call starts from ``prefill``'s device state when slots were just prefilled
        (their tokens are read back and delivered while it runs, so no host trip separates
        the prefill from decoding). Each next call starts from the previous
        call's slot state on the device and is dispatched before the previous call's tokens
        are read back and delivered, so the host work of one call overlaps the device work of
        the next. Host-side changes (admissions, cancellations, swaps, commands) wait for the
        chain to end, at most one call later.
        """
        a = self._slots.arrays
        live = a.active | (prefill.may_decode if prefill else False)
        if not live.any():  # nothing to decode: only a prefill, whose tokens may finish it
            if prefill:
                self._deliver_prefill(prefill)
            return
        reach = max(int(a.positions[a.active].max(initial=0)), prefill.reach if prefill else 0)
        rows = self._rows(live)
        state = prefill.state if prefill else jax.device_put(a, self._placement)
        current = self._dispatch(state, reach, rows)
        if prefill:
            self._deliver_prefill(prefill)
        while True:
            chained = None
            if self._may_chain():
                reach += self._steps
                chained = self._dispatch(current[0], reach, rows)
            new, tokens, logprobs, status = jax.device_get(current)
            for seq, chunk in self._slots.absorb(new, tokens, logprobs, status, self.version):
                self._send(seq, chunk)
            if chained is None:
                return
            current = chained
            # The slots active after the call just read back include every slot active when
            # the next call starts (one later), so the batch shrinks as sequences finish.
            rows = self._rows(self._slots.arrays.active)

    def _rows(self, active: np.ndarray) -> np.ndarray:
        """The slots a decode call computes: every ``active`` one, padded with inactive ones to
        the smallest batch bucket that holds them (ascending, distinct)."""
        size = next(b for b in self._batch_buckets if b >= active.sum())
        return np.sort(np.argsort(~active, kind="stable")[:size]).astype(np.int32)

    def _dispatch(self, slots: jax_decode.SlotArrays, reach: int, rows: np.ndarray) -> tuple:
        """Start one decode call from ``slots`` (positions at most ``reach``) computing the
        slots ``rows``; its outputs."""
        window = next((b for b in self._buckets if b >= reach + self._steps), self._buckets[-1])
        self._cache, new, tokens, logprobs, status = jax_decode.decode(
            self._graphdef, self._steps, window, self._params, self._layers, self._cache,
            self._stop_mask, slots, rows,
        )
        self.decode_calls += 1
        self.decode_rows += len(rows)
        return new, tokens, logprobs, status

    def _may_chain(self) -> bool:
        """True when another decode call may start before the host catches up.

        Called while a call runs, before its results are read: the host arrays still hold the
        state it started from."""
        a = self._slots.arrays
        with self._cond:
            if self._commands or self._swap is not None or self._paused or self._closing:
                return False
            if any(s.cancelled for s in self._pending):
                return False
            # Requests wait and a slot frees up (or reaches its length in the running call):
            # read back and refill it rather than decode a call with it idle.
            ending = (a.remaining[a.active] <= self._steps).any()
            if self._pending and (self._slots.free() or ending):
                return False
        return a.active.any() and not any(
            self._slots.seqs[b].cancelled for b in self._slots.occupied()
        )

    @staticmethod
    def _send(seq: Sequence, chunk: GenerationChunk) -> None:
        if chunk.finish_reason is not None:
            seq.finish(chunk)
        else:
            seq.deliver(chunk)

    def _end(self) -> None:
        """Abort or fail every sequence and command left; later calls are refused."""
        with self._cond:
            self._stopped = True
            pending, self._pending = list(self._pending), collections.deque()
            commands, self._commands = list(self._commands), collections.deque()
        final = self.error or ABORTED
        for seq in [self._slots.seqs[b] for b in self._slots.occupied()] + pending:
            if not seq.cancelled:
                seq.finish(final)
        self._slots = SlotTable(len(self._slots.seqs))
        refused = self.error or EngineError("the engine has shut down")
        for _, fut in commands:
            _settle(fut, error=refused)
        if self._swap is not None:
            _settle(self._swap[2], error=refused)
        if self._close_future is not None:
            _settle(self._close_future)


def _settle(fut: Future, error: BaseException | None = None) -> None:
    """Resolve a command's future, unless its caller already gave up on it (cancelled)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
