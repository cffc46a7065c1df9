"""Test doubles for rollout tests: a character tokenizer, an arithmetic engine, a scorer.

The engine answers the last ``a+b=`` in its context with the digits of ``a+b`` and then EOS, one
token per step. Greedy requests (temperature 0) always get the right sum; sampled ones get
``a+b+1`` for odd seeds, so a group with seeds s, s+1, ... alternates right and wrong answers.
Each token's log-prob is ``-(version + 1) - position / 100`` so tests can tell which weights
produced it.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

from areal_jax.trajectory import TrajectoryGroup
from rollout.engine import (
    EngineError,
    GenerationChunk,
    GenerationEngine,
    SamplingParams,
    WeightLoadError,
)
from rollout.workflows import Workflow
from rollout.workflows.single_turn import SingleTurnWorkflow

CHARS = list("0123456789+= ?") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
EOS_ID = 0
UNK_ID = 1
VOCAB = {"[EOS]": EOS_ID, "[UNK]": UNK_ID, **{c: i + 2 for i, c in enumerate(CHARS)}}
ID_TO_CHAR = {i: c for c, i in VOCAB.items() if len(c) == 1}


async def until(condition, timeout_s: float = 10.0) -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def make_tokenizer_dir(path: Path) -> Path:
    """Save a character-level Hugging Face tokenizer over ``VOCAB`` into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]")
    fast.save_pretrained(path)
    return path


def write_checkpoint(path: Path, marker: str) -> Path:
    """A directory the arithmetic engine accepts as a checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"marker": marker}))
    (path / "model.safetensors").write_bytes(marker.encode() * 1000)
    return path


class ArithmeticEngine(GenerationEngine):
    """Deterministic engine double; see the module docstring."""

    kind = "arithmetic"

    def __init__(
        self,
        step_s: float = 0.0,
        max_context_len: int = 64,
        version: int = 0,
        fail_on: str | None = None,
    ):
        self.step_s = step_s
        self.fail_on = fail_on
        self._context_len = max_context_len
        self._version = version
        self._running = asyncio.Event()
        self._running.set()
        self.closed = False
        self.started = False
        self._failure: EngineError | None = None
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.loaded: list[tuple[str, int, dict[str, bytes]]] = []
        self.active = 0
        self.tokens = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    @property
    def max_context_len(self) -> int:
        return self._context_len

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def failure(self) -> EngineError | None:
        return self._failure

    def die(self, why: str = "worker thread died") -> None:
        """Fail for good (callable from any thread): every generate raises from now on."""
        self._failure = EngineError(why)

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.closed = True
        self._running.set()

    def answer(self, context: list[int], params: SamplingParams, request_id: str) -> list[int]:
        text = "".join(ID_TO_CHAR.get(t, "") for t in context)
        sums = re.findall(r"(\d+)\+(\d+)=", text)
        if not sums:
            return [VOCAB["?"]] * params.max_new_tokens
        a, b = sums[-1]
        value = int(a) + int(b)
        if not params.greedy:
            seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
            value += seed % 2
        return encode(str(value)) + [EOS_ID]

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        self.requests.append((request_id, list(prompt_ids), params))
        if self._failure is not None:
            raise self._failure
        if self.fail_on is not None and encode(self.fail_on) == list(prompt_ids):
            raise EngineError("backend lost")
        planned = self.answer(list(prompt_ids), params, request_id)
        stops = set(params.stop_token_ids) | {EOS_ID}
        self.active += 1
        try:
            for position in range(params.max_new_tokens):
                await self._running.wait()
                if self.closed:
                    yield GenerationChunk((), (), (), "abort")
                    return
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                if self._failure is not None:
                    raise self._failure
                token = planned[position] if position < len(planned) else VOCAB["?"]
                logprob = -(self._version + 1) - position / 100
                last = token in stops or position + 1 == params.max_new_tokens
                finish = ("stop" if token in stops else "length") if last else None
                self.tokens += 1
                yield GenerationChunk((token,), (logprob,), (self._version,), finish)
                if last:
                    return
        finally:
            self.active -= 1

    async def update_weights(self, path: str, version: int) -> None:
        directory = Path(path)
        try:
            json.loads((directory / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise WeightLoadError(f"cannot load {path}: {e}") from e
        files = {p.name: p.read_bytes() for p in directory.iterdir()}
        self.loaded.append((path, version, files))
        self._version = version

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    def stats(self) -> dict[str, float]:
        return {"active_sequences": self.active}


def exact_reward(completion: str, metadata: dict) -> float:
    """A reward function; servers offer it as ``rewards.custom: {exact: <this dotted path>}``."""
    return 1.0 if completion.strip() == metadata.get("answer") else 0.0


def broken_reward(completion: str, metadata: dict) -> float:
    """A reward reading a metadata key requests do not carry: it raises on every call."""
    return float(metadata["no_such_key"] in completion)


class ExactAnswerScorer:
    """Reward 1.0 when the completion equals ``metadata["answer"]``, else 0.0."""

    names = ("exact",)

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls: list[tuple[str, str, dict]] = []

    async def score(self, reward_name: str, completion: str, metadata: dict) -> float:
        self.calls.append((reward_name, completion, metadata))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return exact_reward(completion, metadata)


class FailingScorer(ExactAnswerScorer):
    """``ExactAnswerScorer`` whose calls fail (score 0, with an error, as ``RewardPool`` does)
    for the answers ``fails(metadata["answer"])`` picks."""

    def __init__(self, fails=lambda answer: True):
        super().__init__()
        self.fails = fails

    async def score_with_error(self, reward_name: str, completion: str, metadata: dict):
        if self.fails(metadata["answer"]):
            return 0.0, f"reward {reward_name} failed: KeyError: 'no_such_key'"
        return await self.score(reward_name, completion, metadata), None


class MislabelledWorkflow(Workflow):
    """Breaks the workflow contract: answers with another group id."""

    async def run(self, task, engine, scorer) -> TrajectoryGroup:
        return TrajectoryGroup("someone-else", [])


class ShortGroupWorkflow(SingleTurnWorkflow):
    """Breaks the workflow contract: one trajectory fewer than the request's group_size."""

    async def run(self, task, engine, scorer) -> TrajectoryGroup:
        group = await super().run(task, engine, scorer)
        return TrajectoryGroup(group.group_id, group.trajectories[:-1])
