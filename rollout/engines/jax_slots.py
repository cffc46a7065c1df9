"""Host-side bookkeeping of the JAX engine: the requests, and which slot each one occupies.

A ``Sequence`` is one request as the worker thread sees it: prompt, sampling parameters, the
tokens produced so far and a ``deliver`` callback that hands chunks to the request's async
generator on the event loop. ``SlotTable`` mirrors the device's per-slot arrays in NumPy: the
worker fills a row when it prefills a slot, reads back rows after each decode call, and turns
the sampled tokens into ``GenerationChunk``s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

# Any top_k above the vocabulary keeps all of it; so does this one, the largest int32.
_ALL_TOKENS = np.iinfo(np.int32).max

from rollout.engine import GenerationChunk, SamplingParams
from rollout.engines.jax_decode import IDLE, LENGTH, RUNNING, STOP, SlotArrays
from rollout.engines.jax_sampling import seed_words

FINISH = {STOP: "stop", LENGTH: "length"}


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request: what to generate, what has been generated, where chunks go."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one the engine drew for it
    stop_row: np.ndarray  # [V] bool: the request's stop ids and the model's eos ids
    deliver: Callable[[GenerationChunk | BaseException], None]
    output: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False  # set by the event loop when the consumer went away
    done: bool = False  # its last chunk was delivered

    @property
    def context(self) -> list[int]:
        """Prompt and output so far: what a (re-)prefill reads."""
        return self.prompt + self.output

    def finish(self, chunk: GenerationChunk | BaseException) -> None:
        self.done = True
        self.deliver(chunk)


class SlotTable:
    """``num_slots`` decode slots: their sequences and a NumPy copy of the device arrays."""

    def __init__(self, num_slots: int):
        self.seqs: list[Sequence | None] = [None] * num_slots
        self.unfilled = np.zeros(num_slots, bool)  # cache row not (or no longer) valid: prefill
        self.arrays = SlotArrays(
            tokens=np.zeros(num_slots, np.int32),
            positions=np.zeros(num_slots, np.int32),
            remaining=np.zeros(num_slots, np.int32),
            active=np.zeros(num_slots, bool),
            temperature=np.zeros(num_slots, np.float32),
            top_k=np.full(num_slots, -1, np.int32),
            top_p=np.ones(num_slots, np.float32),
            seeds=np.zeros((num_slots, 2), np.uint32),
        )

    def free(self) -> list[int]:
        return [b for b, seq in enumerate(self.seqs) if seq is None]

    def occupied(self) -> list[int]:
        return [b for b, seq in enumerate(self.seqs) if seq is not None]

    @property
    def running(self) -> int:
        return len(self.occupied())

    def assign(self, slot: int, seq: Sequence) -> None:
        """Give ``slot`` to ``seq``; it decodes once prefilled."""
        self.seqs[slot] = seq
        self.invalidate(slot)

    def invalidate(self, slot: int) -> None:
        """Mark ``slot``'s cache row unusable (new weights): it must be prefilled again."""
        self.unfilled[slot] = True
        self.arrays.active[slot] = False

    def release(self, slot: int) -> None:
        self.seqs[slot] = None
        self.unfilled[slot] = False
        self.arrays.active[slot] = False

    @staticmethod
    def requests(seqs: list[Sequence], rows: int) -> SlotArrays:
        """The sampling fields of ``seqs`` in the first rows of a ``rows``-row ``SlotArrays``
        (prefill input; the other rows are greedy and unused)."""
        fields = SlotTable(rows).arrays
        for i, seq in enumerate(seqs):
            p = seq.params
            fields.remaining[i] = p.max_new_tokens - len(seq.output)
            fields.temperature[i], fields.top_k[i], fields.top_p[i] = (
                p.temperature, min(p.top_k, _ALL_TOKENS), p.top_p)
            fields.seeds[i] = seed_words(seq.seed)
        return fields

    def filled(self, slot: int, row: int, requests: SlotArrays, token: int, logprob: float,
               status: int, version: int) -> GenerationChunk:
        """Record that prefilling ``slot`` (row ``row`` of ``requests``) sampled ``token``; the
        chunk to deliver."""
        seq = self.seqs[slot]
        a = self.arrays
        for field in ("temperature", "top_k", "top_p", "seeds"):
            getattr(a, field)[slot] = getattr(requests, field)[row]
        a.tokens[slot] = token
        a.positions[slot] = len(seq.context)
        a.remaining[slot] = requests.remaining[row] - 1
        a.active[slot] = status == RUNNING
        self.unfilled[slot] = False
        return self._record(slot, [token], [logprob], status, version)

    def absorb(self, new: SlotArrays, tokens: np.ndarray, logprobs: np.ndarray,
               status: np.ndarray, version: int) -> list[tuple[Sequence, GenerationChunk]]:
        """Take a decode call's results (tokens/logprobs/status [steps, B]); chunks per sequence."""
        for field in ("tokens", "positions", "remaining", "active"):
            getattr(self.arrays, field)[:] = getattr(new, field)
        out = []
        for b in self.occupied():
            emitted = status[:, b] != IDLE
            if not emitted.any():
                continue
            seq = self.seqs[b]
            last = int(status[emitted, b][-1])
            chunk = self._record(b, tokens[emitted, b].tolist(), logprobs[emitted, b].tolist(),
                                 last, version)
            out.append((seq, chunk))
        return out

    def _record(self, slot: int, tokens: list[int], logprobs: list[float], status: int,
                version: int) -> GenerationChunk:
        seq = self.seqs[slot]
        seq.output += tokens
        finish = FINISH.get(status)
        if finish is not None:
            self.release(slot)
        return GenerationChunk(tuple(tokens), tuple(logprobs), (version,) * len(tokens), finish)
