"""The generation-engine contract that every rollout engine (JAX, SGLang) implements.

An engine turns a prompt (token ids) into a stream of sampled tokens. The rollout server and
workflows use nothing else of it, so an engine can be swapped without touching them.

Contract
--------
* ``start()`` loads the model; afterwards ``version``, ``vocab_size`` and ``max_context_len``
  are valid. ``shutdown()`` ends every in-flight ``generate`` with a final chunk whose
  ``finish_reason`` is ``"abort"``, then releases the engine's resources; a ``generate`` after
  it yields just that final chunk.
* ``generate(prompt_ids, params, request_id)`` yields ``GenerationChunk``s. Each chunk carries
  the new token ids, the log-prob of each sampled token and the weight version that produced
  each token. The log-prob is ``log_softmax(logits / temperature)`` over the full vocabulary,
  taken before top-p/top-k filtering (so not renormalised); greedy decoding (temperature below
  ``GREEDY_TEMPERATURE``, 0 included, as in SGLang) reports ``log_softmax(logits)``. The last
  chunk, and only it, has ``finish_reason``:
  ``"stop"`` (a token of ``params.stop_token_ids`` or one of the model's end-of-sequence ids was
  sampled; that token is the last output token), ``"length"`` (``max_new_tokens`` produced) or
  ``"abort"`` (the engine shut down or aborted the request; the tokens so far are valid). A last
  chunk may hold no tokens. Callers have validated ``params`` against ``vocab_size`` and checked
  ``len(prompt_ids) + params.max_new_tokens <= max_context_len``. Closing or cancelling the
  iterator early releases the request's resources in the engine.
* ``update_weights(path, version)`` loads a Hugging Face checkpoint directory. In-flight requests
  are interrupted, not aborted: they continue with the new weights after re-reading
  prompt + tokens so far, so one output may mix versions, and each token keeps the version that
  produced it. On a missing, corrupt or mismatched checkpoint it raises ``WeightLoadError``,
  keeps serving the previous weights and leaves ``version`` unchanged. The server never runs two
  updates at once.
* ``pause()`` stops token production (in-flight and new requests wait, nothing is aborted) until
  ``resume()``; both are idempotent, ``paused`` tells which, and an update while paused stays
  paused.
* ``stats()`` returns engine-specific numbers (e.g. ``{"running_slots": 3}``) for status reports.
* Engine failures surface from ``generate`` as ``EngineError``. One request's failure may be
  passing; ``failure`` tells when the engine has failed for good (the JAX worker thread died, the
  SGLang process exited or stopped answering): it is None while the engine can serve, and then
  the ``EngineError`` saying why, which every later ``generate`` raises. The server watches it
  and, once set, fails every unfinished request as UNAVAILABLE and exits.

A module that provides an engine kind exposes ``build_engine(config) -> GenerationEngine``
(``config`` is ``rollout.config.EngineConfig``); see ``rollout.engines``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Literal

from areal_jax.protocol import GREEDY_TEMPERATURE

MAX_VERSION = 2**31 - 1  # weight versions: every generated token records its own as an int32
MAX_STOP_TOKEN_IDS = 256  # a request's own stop ids (each answer checks its tokens against them)

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """The engine failed to serve a request (crashed backend, lost connection, ...)."""


class WeightLoadError(EngineError):
    """A checkpoint could not be loaded; the engine still serves the previous weights."""


class InvalidParamError(ValueError):
    """A request parameter is invalid; ``field`` names it, the message says why."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def prefixed(self, prefix: str) -> InvalidParamError:
        """The same error with ``prefix.`` in front of the field name."""
        return InvalidParamError(f"{prefix}.{self.field}", self.problem)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence. ``temperature < GREEDY_TEMPERATURE`` (e.g. 0) means greedy.

    Invalid values raise ``InvalidParamError`` naming the field; ``validate(vocab_size)`` also
    checks the stop ids against the vocabulary.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``InvalidParamError`` for the first invalid field."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidParamError(
                "max_new_tokens", f"must be an integer, got {self.max_new_tokens!r}"
            )
        if self.max_new_tokens < 1:
            raise InvalidParamError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise InvalidParamError("temperature",
                                    f"must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParamError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise InvalidParamError("top_k", f"must be -1 (all) or >= 1, got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise InvalidParamError("seed", f"must be >= 0, got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParamError("stop_token_ids", f"{len(self.stop_token_ids)} ids, at most "
                                    f"{MAX_STOP_TOKEN_IDS}")
        for i, tok in enumerate(self.stop_token_ids):
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise InvalidParamError(
                    f"stop_token_ids[{i}]", f"{tok} is outside the vocabulary {bound}"
                )


@dataclasses.dataclass(frozen=True)
class GenerationChunk:
    """Tokens sampled since the previous chunk; ``finish_reason`` is set on the last chunk only."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason | None = None

    def __post_init__(self):
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"GenerationChunk: {n} token_ids, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions (must be equal)"
            )
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"GenerationChunk.finish_reason {self.finish_reason!r} is not one of "
                f"{FINISH_REASONS}"
            )


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """A whole generated sequence: the concatenation of its chunks."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason


async def collect(chunks: AsyncIterator[GenerationChunk]) -> GenerationResult:
    """Concatenate a chunk stream into a ``GenerationResult``."""
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    finish: FinishReason | None = None
    async for chunk in chunks:
        if finish is not None:
            raise EngineError("generation stream went on after its final chunk")
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        finish = chunk.finish_reason
    if finish is None:
        raise EngineError("generation stream ended without a finish reason")
    return GenerationResult(ids, logprobs, versions, finish)


class GenerationEngine(abc.ABC):
    """Base class of generation engines; the module docstring states the contract."""

    kind: str = ""
    # Whether ``generate`` yields tokens as they are generated (False: a sequence's tokens come
    # when it ends, as with SGLang's non-streamed answers): a client watching the token count
    # for progress can rely on it only then.
    tokens_as_generated: bool = True

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Version of the weights now serving."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model accepts and samples from."""

    @property
    @abc.abstractmethod
    def max_context_len(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and get ready to serve."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort in-flight requests (their last chunk says ``"abort"``) and release resources."""

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the tokens sampled for one sequence (an async generator)."""

    async def generate_full(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> GenerationResult:
        """Generate one sequence and return it whole."""
        return await collect(self.generate(prompt_ids, params, request_id))

    @abc.abstractmethod
    async def update_weights(self, path: str, version: int) -> None:
        """Swap in the checkpoint at ``path`` as ``version``; ``WeightLoadError`` keeps the old."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop producing tokens until ``resume``."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after ``pause``."""

    @property
    @abc.abstractmethod
    def paused(self) -> bool:
        """Whether the engine is paused."""

    @property
    def failure(self) -> EngineError | None:
        """Why the engine can no longer serve anything; None while it can."""
        return None

    def stats(self) -> dict[str, Any]:
        """Engine-specific numbers for status reports (numeric values only)."""
        return {}
