"""Seeded fuzzing of the request space: every failure has a documented code, the server lives on."""

import asyncio
import math
import random
import types

import grpc
import pytest
from _rollout_fakes import VOCAB, make_tokenizer_dir, write_checkpoint
from _rollout_harness import rollout, rollout_request, serving

from areal_jax.protocol import push_weight_requests
from areal_jax.protocol import rollout_pb2 as pb

CASES = 300
FAILED_CALL = {
    "Generate": {grpc.StatusCode.INVALID_ARGUMENT},
    "PushWeights": {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    },
}
ERROR_GROUP = {grpc.StatusCode.INVALID_ARGUMENT.value[0]}  # the arithmetic engine never fails
FLOATS = [0.0, 1e-30, 0.5, 1.0, 2.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 5e-324]
INTS = [0, 1, -1, 3, 7, 8, 41, 42, 64, 255, 2**31 - 1, -(2**31)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


WILD = 0.12  # chance that a field gets an arbitrary value instead of a valid one


def _text(rng: random.Random) -> str:
    return "".join(rng.choice("ab/#$%:.\u00e9\u4e2d0 ") for _ in range(rng.randrange(6)))


def _wild(rng: random.Random) -> bool:
    return rng.random() < WILD


def _sampling(rng: random.Random) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_new_tokens=rng.choice(INTS) if _wild(rng) else rng.randrange(1, 9))
    if _wild(rng):
        msg.temperature = rng.choice(FLOATS)
    elif rng.random() < 0.5:
        msg.temperature = rng.choice([0.0, 1e-30, 0.7, 1.0])
    if _wild(rng):
        msg.top_p = rng.choice(FLOATS)
    if _wild(rng):
        msg.top_k = rng.choice(INTS)
    msg.greedy = _wild(rng)
    if _wild(rng):
        msg.stop_token_ids.extend(rng.choice(INTS) for _ in range(rng.randrange(1, 3)))
    if rng.random() < 0.5:
        msg.seed = rng.choice([0, 1, 2**64 - 1])
    return msg


def _prompt(rng: random.Random) -> list[int]:
    if _wild(rng):
        return [rng.choice(INTS) for _ in range(rng.randrange(0, 70))]
    return [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(1, 12))]


def _rollout_request(rng: random.Random, i: int) -> pb.RolloutRequest:
    msg = pb.RolloutRequest(
        request_id="" if _wild(rng) else f"{i}-{_text(rng)}",
        prompt_ids=_prompt(rng),
        prompt_text=_text(rng),
        metadata={_text(rng): _text(rng) for _ in range(rng.randrange(3))},
        reward_name=rng.choice(["", "builtins:exec", "os:system", _text(rng)])
        if _wild(rng)
        else "exact",
        group_size=rng.choice([0, -1, 300, 2**31 - 1]) if _wild(rng) else rng.randrange(1, 3),
    )
    if not _wild(rng):
        msg.sampling_params.CopyFrom(_sampling(rng))
    return msg


def _garbage(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))


def _push(rng: random.Random, src) -> list:
    requests = list(push_weight_requests(src, rng.choice([-1, 0, 1, 5]), chunk_bytes=700,
                                         force=rng.random() < 0.5))
    header = requests[0].header
    mutation = rng.randrange(6)
    if mutation == 0:
        header.files[rng.randrange(len(header.files))].name = rng.choice(["", "..", "a/b", "x"])
    elif mutation == 1:
        header.files[0].size = rng.choice([-5, 0, 2**62])
    elif mutation == 2:
        requests[1].chunk.offset = rng.choice([-1, 1, 10**9])
    elif mutation == 3:
        rng.shuffle(requests)
    elif mutation == 4:
        del requests[rng.randrange(len(requests)):]
    return requests


def _raw(channel: grpc.aio.Channel, method: str, kind: str):
    """A call that sends raw bytes (to send messages that do not decode)."""
    path = f"/areal_jax.rollout.v1.RolloutService/{method}"
    return getattr(channel, kind)(path, request_serializer=bytes, response_deserializer=bytes)


def test_fuzzed_requests_fail_only_with_documented_codes(tmp_path, tok_dir):
    rng = random.Random(1234)
    src = write_checkpoint(tmp_path / "src", "fuzz")

    async def failure(call) -> grpc.StatusCode | None:
        try:
            await call
        except grpc.aio.AioRpcError as e:
            return e.code()
        return None

    async def drain(stream) -> grpc.StatusCode | None:
        try:
            async for _ in stream:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
        return None

    async def scenario():
        codes = {"Generate": [], "PushWeights": []}
        requests = [_rollout_request(rng, i) for i in range(CASES)]
        async with serving(tmp_path, tok_dir) as h:
            groups = await rollout(h.stub, requests)
            raw_stub = types.SimpleNamespace(Rollout=_raw(h.channel, "Rollout", "stream_stream"))
            garbage = await rollout(raw_stub, [_garbage(rng) for _ in range(3)])
            for _ in range(CASES // 3):
                req = pb.GenerateRequest(request_id=_text(rng) or "g", prompt_ids=_prompt(rng))
                if not _wild(rng):
                    req.sampling_params.CopyFrom(_sampling(rng))
                codes["Generate"].append(await drain(h.stub.Generate(req)))
                raw = _raw(h.channel, "Generate", "unary_stream")(_garbage(rng))
                codes["Generate"].append(await drain(raw))
            for _ in range(CASES // 10):
                codes["PushWeights"].append(await failure(h.stub.PushWeights(_push(rng, src))))
            raw = _raw(h.channel, "PushWeights", "stream_unary")(iter([_garbage(rng)]))
            codes["PushWeights"].append(await failure(raw))
            after = await rollout(h.stub, [rollout_request("after")])
            status = await h.stub.GetStatus(pb.GetStatusRequest())
        return requests, groups, garbage, codes, after, status

    requests, groups, garbage, codes, after, status = asyncio.run(scenario())
    sizes = {r.request_id: r.group_size for r in requests}
    assert len(groups) == CASES
    failed = [g for g in groups if g.HasField("error")]
    assert 0 < len(failed) < CASES
    for group in failed:
        assert group.error.code in ERROR_GROUP and group.error.field, group.error
    for group in groups:
        if not group.HasField("error"):
            assert len(group.trajectories) == sizes[group.request_id]
    # undecodable messages get error groups; the stream itself ends cleanly
    garbage = [pb.TrajectoryGroup.FromString(g) for g in garbage]
    assert garbage and all(g.error.code in ERROR_GROUP for g in garbage)
    for rpc, seen in codes.items():
        assert {c for c in seen if c is not None} <= FAILED_CALL[rpc], (rpc, seen)
    assert None in codes["Generate"] and None in codes["PushWeights"]  # some valid ones passed
    assert not after[0].HasField("error") and len(after[0].trajectories) == 2
    assert status.running_requests == status.queued_requests == 0
