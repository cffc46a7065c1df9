"""The rollout server through real gRPC on loopback, with an engine double and a scorer double."""

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from _rollout_fakes import (
    EOS_ID,
    ArithmeticEngine,
    ExactAnswerScorer,
    encode,
    make_tokenizer_dir,
    until,
    write_checkpoint,
)
from _rollout_harness import rollout, rollout_request, server_config, serving
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from areal_jax import cli
from areal_jax.config import ConfigError, from_dict
from areal_jax.controller.servers import make_pool
from areal_jax.experiment import ExperimentConfig
from areal_jax.controller.rollout_pool import RolloutPool
from areal_jax.protocol import SERVICE_NAME, group_from_proto, push_weight_requests
from areal_jax.protocol import rollout_pb2 as pb
from rollout import engines, service, weight_intake
from rollout.service import PUSH_DRAIN_S
from rollout.weight_intake import PushStream
from rollout.admission import Admission, AdmissionClosed
from rollout.config import EngineConfig, ServerConfig
from rollout.engine import InvalidParamError, SamplingParams
from rollout.server import _reward_pool, serve, start_server
from rollout.timing import ActivityClock

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def test_rollout_stream_returns_complete_scored_groups(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            requests = [
                rollout_request("a", "12+7=", "19", group_size=4, seed=0),
                rollout_request("b", "3+4=", "7", group_size=2, temperature=0.0),
            ]
            return await rollout(h.stub, requests), h.scorer.calls

    responses, calls = asyncio.run(scenario())
    by_id = {r.request_id: r for r in responses}
    assert set(by_id) == {"a", "b"}
    a = group_from_proto(by_id["a"])
    assert [t.reward for t in a.trajectories] == [1.0, 0.0, 1.0, 0.0]
    np.testing.assert_array_equal(a.trajectories[0].prompt_ids, encode("12+7="))
    np.testing.assert_array_equal(a.trajectories[0].output_ids, encode("19") + [EOS_ID])
    np.testing.assert_array_equal(a.trajectories[1].output_ids, encode("20") + [EOS_ID])
    np.testing.assert_allclose(a.trajectories[0].behav_logprobs, [-1.0, -1.01, -1.02])
    assert all(t.finish_reason == "stop" for t in a.trajectories)
    assert a.metadata["timing"]["generation_s"] > 0
    b = group_from_proto(by_id["b"])
    assert [t.reward for t in b.trajectories] == [1.0, 1.0]
    assert len(calls) == 6


MALFORMED = [
    ("request_id", dict(request_id="")),
    ("prompt_ids", dict(prompt_ids=[])),
    ("prompt_ids[1]", dict(prompt_ids=[3, 42, 4])),
    ("prompt_ids[0]", dict(prompt_ids=[-1])),
    ("sampling_params.max_new_tokens", dict(sampling=dict(max_new_tokens=60))),  # 5 + 60 > 64
    ("sampling_params.max_new_tokens", dict(sampling=dict(max_new_tokens=0))),
    ("sampling_params.temperature", dict(sampling=dict(temperature=-0.5))),
    ("sampling_params.top_p", dict(sampling=dict(top_p=0.0))),
    ("sampling_params.top_p", dict(sampling=dict(top_p=1.5))),
    ("sampling_params.top_k", dict(sampling=dict(top_k=0))),
    ("sampling_params.stop_token_ids[1]", dict(sampling=dict(stop_token_ids=[3, 99]))),
    # each answer checked its tokens against every stop id: 8M of them froze the server
    ("sampling_params.stop_token_ids", dict(sampling=dict(stop_token_ids=[3] * 257))),
    # the length is checked before any id is read (a 48 MiB prompt took 5 s of the event loop)
    ("prompt_ids", dict(prompt_ids=[-1] + [3] * 63)),  # 64 tokens: no room in the 64 context
    ("sampling_params.greedy", dict(sampling=dict(greedy=True, temperature=0.7))),
    ("sampling_params", dict(sampling=None)),
    ("reward_name", dict(reward_name="math_verify")),
    ("group_size", dict(group_size=0)),
    ("group_size", dict(group_size=300)),
]


def _malformed(index: int, fields: dict) -> pb.RolloutRequest:
    req = rollout_request(f"bad-{index}")
    fields = dict(fields)
    sampling = fields.pop("sampling", {})
    if sampling is None:
        req.ClearField("sampling_params")
    else:
        for key, value in sampling.items():
            if isinstance(value, list):
                getattr(req.sampling_params, key).extend(value)
            else:
                setattr(req.sampling_params, key, value)
    for key, value in fields.items():
        if isinstance(value, list):
            req.ClearField(key)
            getattr(req, key).extend(value)
        else:
            setattr(req, key, value)
    return req


def test_malformed_requests_get_invalid_argument_naming_the_field(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            requests = [_malformed(i, fields) for i, (_, fields) in enumerate(MALFORMED)]
            requests.append(rollout_request("good"))
            return await rollout(h.stub, requests)

    responses = asyncio.run(scenario())
    assert len(responses) == len(MALFORMED) + 1
    by_id = {r.request_id: r for r in responses}
    for i, (field, _) in enumerate(MALFORMED):
        request_id = "" if field == "request_id" else f"bad-{i}"
        error = by_id[request_id].error
        assert (error.code, error.field) == (INVALID, field), (field, error)
        assert error.message.startswith(f"{field}: ")
        assert not by_id[request_id].trajectories
    # the stream stayed open: the valid request after all of them completed
    assert not by_id["good"].HasField("error")
    assert len(by_id["good"].trajectories) == 2


def test_messages_that_do_not_decode_are_invalid_arguments(tmp_path, tok_dir):
    garbage = b"\xff\xff\xff\x07garbage"

    def raw(channel, method, kind):
        path = f"/{SERVICE_NAME}/{method}"
        return getattr(channel, kind)(path, request_serializer=bytes, response_deserializer=bytes)

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            with pytest.raises(grpc.aio.AioRpcError) as update:
                await raw(h.channel, "UpdateWeights", "unary_unary")(garbage)
            call = raw(h.channel, "Rollout", "stream_stream")()
            await call.write(rollout_request("before").SerializeToString())
            await call.write(garbage)
            await call.done_writing()
            groups = [pb.TrajectoryGroup.FromString(g) async for g in call]
            return update.value, groups

    update, groups = asyncio.run(scenario())
    assert update.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert update.details().startswith("request: the message does not decode")
    by_id = {g.request_id: g for g in groups}
    assert len(by_id["before"].trajectories) == 2  # admitted before the bad message: delivered
    assert (by_id[""].error.code, by_id[""].error.field) == (INVALID, "request")


def test_status_messages_are_cut_to_what_a_client_accepts():
    # A gRPC client drops a status whose trailer is over 8-16 KiB (percent-encoded): the caller
    # got RESOURCE_EXHAUSTED "Stream removed" instead of the error.
    from rollout.wire import MAX_STATUS_MESSAGE_BYTES, bounded_message

    assert bounded_message("path: is not under weights_allowed_roots") == (
        "path: is not under weights_allowed_roots")
    cut = bounded_message("é" * 5000)  # 10000 bytes of UTF-8, cut between characters
    assert len(cut.encode()) <= MAX_STATUS_MESSAGE_BYTES
    assert cut.startswith("éé") and cut.endswith("é... (cut: 10000 bytes in all)")


def test_requests_may_name_only_the_configured_rewards(tmp_path, tok_dir):
    rewards = {"num_workers": 1, "custom": {"exact": "_rollout_fakes:exact_reward",
                                            "broken": "_rollout_fakes:broken_reward"}}

    async def scenario():
        config = server_config(tmp_path, tok_dir, rewards=rewards)
        server = await start_server(config, engine=ArithmeticEngine())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pb_stub(channel)
                requests = [
                    rollout_request("custom", reward_name="exact"),
                    rollout_request("broken", reward_name="broken"),
                    rollout_request("exec", reward_name="builtins:exec"),
                    rollout_request("system", reward_name="os:system"),
                    rollout_request("dotted", reward_name="_rollout_fakes.encode"),
                    rollout_request("unknown", reward_name="no_such_reward"),
                ]
                return await rollout(stub, requests)
        finally:
            await server.stop(grace=1.0)

    by_id = {r.request_id: r for r in asyncio.run(scenario())}
    assert [t.reward for t in by_id["custom"].trajectories] == [1.0, 0.0]
    assert by_id["custom"].reward_failures == 0 and not by_id["custom"].reward_error
    # A reward that raises scores 0, and the group says so: two failed calls, the first's error.
    assert [t.reward for t in by_id["broken"].trajectories] == [0.0, 0.0]
    assert (by_id["broken"].reward_calls, by_id["broken"].reward_failures) == (2, 2)
    assert by_id["custom"].reward_calls == 2
    assert by_id["broken"].reward_error.startswith("reward broken failed: KeyError")
    assert "no_such_key" in by_id["broken"].reward_error
    for request_id in ("exec", "system", "dotted", "unknown"):
        error = by_id[request_id].error
        assert (error.code, error.field) == (INVALID, "reward_name"), request_id
        assert "available: " in error.message and "code, code_fraction" in error.message
        assert "exact" in error.message.split("available: ")[1]
        assert not by_id[request_id].trajectories


def test_a_custom_reward_that_does_not_import_stops_the_start(tmp_path, tok_dir):
    rewards = {"num_workers": 1, "custom": {"mine": "no_such_module_here:score"}}
    config = server_config(tmp_path, tok_dir, rewards=rewards)
    with pytest.raises(ConfigError, match="rewards.custom: .*no_such_module_here"):
        asyncio.run(start_server(config, engine=ArithmeticEngine()))


def test_engine_failures_are_reported_per_request(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir, engine=ArithmeticEngine(fail_on="9+9=")) as h:
            requests = [rollout_request("boom", "9+9=", "18"), rollout_request("fine")]
            return await rollout(h.stub, requests)

    by_id = {r.request_id: r for r in asyncio.run(scenario())}
    assert by_id["boom"].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert by_id["boom"].error.message == "engine: backend lost"
    assert not by_id["fine"].HasField("error") and len(by_id["fine"].trajectories) == 2


@pytest.mark.parametrize("workflow, problem", [
    ("MislabelledWorkflow", "group_id 'someone-else'"),
    ("ShortGroupWorkflow", "1 trajectories for group_size 2"),
])
def test_a_plug_in_workflow_breaking_its_contract_fails_only_its_request(
        tmp_path, tok_dir, workflow, problem):
    async def scenario():
        path = {"path": f"_rollout_fakes.{workflow}"}
        async with serving(tmp_path, tok_dir, workflow=path) as h:
            first = await rollout(h.stub, [rollout_request("w")])
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            return first, status

    (response,), status = asyncio.run(scenario())
    assert response.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert problem in response.error.message
    assert (status.running_requests, status.queued_requests) == (0, 0)


def test_a_workflow_failing_every_request_logs_its_first_tracebacks_and_counts_the_rest(
        tmp_path, tok_dir, caplog):
    # Each failed request logged its traceback: a workflow's bug hit by every request of a run
    # filled the server's log with them.
    async def scenario():
        path = {"path": "_rollout_fakes.MislabelledWorkflow"}
        async with serving(tmp_path, tok_dir, workflow=path) as h:
            return await rollout(h.stub, [rollout_request(f"w{i}") for i in range(8)])

    with caplog.at_level("ERROR", logger="rollout.service"):
        responses = asyncio.run(scenario())
    assert [r.error.code for r in responses] == [grpc.StatusCode.INTERNAL.value[0]] * 8
    errors = [r for r in caplog.records if r.name == "rollout.service"]
    assert [r.exc_info is not None for r in errors] == [True] * 5 + [False]
    assert errors[-1].getMessage() == "3 more requests failed with RuntimeError (8 in all)"


def test_a_reply_over_the_message_limit_fails_only_its_group(tmp_path, tok_dir):
    # gRPC ended the whole stream (RESOURCE_EXHAUSTED) when one group's reply was too large,
    # and every other group on it with it.
    async def scenario():
        engine = ArithmeticEngine(max_context_len=8192)
        async with serving(tmp_path, tok_dir, engine=engine, max_message_mb=1) as h:
            big = rollout_request("big", "what", "x", group_size=64, max_new_tokens=4000)
            return await rollout(h.stub, [rollout_request("small"), big,
                                          rollout_request("small2")])

    by_id = {r.request_id: r for r in asyncio.run(scenario())}
    assert set(by_id) == {"small", "big", "small2"}
    err = by_id["big"].error
    assert (err.code, err.field) == (grpc.StatusCode.OUT_OF_RANGE.value[0], "group_size")
    assert "exceeds the server's max_message_mb (1 MiB)" in err.message
    assert not by_id["small"].HasField("error") and not by_id["small2"].HasField("error")
    # A run's controller takes replies as large as its local servers may send.
    cfg = from_dict(ExperimentConfig, {
        "run_dir": str(tmp_path / "run"), "model_path": "tiny",
        "dataset": {"path": "d.jsonl", "reward": "math"},
        "rollout": {"server": {"max_message_mb": 200}}})
    assert make_pool(cfg, ["127.0.0.1:1"]).options.max_message_mb == 200


def test_local_servers_stop_when_their_pool_cannot_be_made(tmp_path, monkeypatch):
    # An unreadable rollout.tls_root_cert raised a raw OSError after the local servers had
    # started, and nothing stopped them until the controller exited.
    from areal_jax.controller import servers as servers_module

    stopped = []

    class Started:
        addresses = ["127.0.0.1:1"]

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(servers_module, "launch_local", lambda *a, **k: Started())
    cfg = from_dict(ExperimentConfig, {
        "run_dir": str(tmp_path / "run"), "model_path": "tiny",
        "dataset": {"path": "d.jsonl", "reward": "math"},
        "rollout": {"tls_root_cert": str(tmp_path / "no-such-ca.pem")}})

    async def scenario():
        async with servers_module.rollout_servers(cfg, tmp_path, 0):
            pass

    with pytest.raises(ConfigError, match=r"rollout.tls_root_cert: cannot read .*no-such-ca.pem: "
                                          r"No such file"):
        asyncio.run(scenario())
    assert stopped == [True]


def test_duplicate_request_id_in_flight_is_rejected(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir, engine=ArithmeticEngine(step_s=0.02)) as h:
            return await rollout(h.stub, [rollout_request("same"), rollout_request("same")])

    first, second = asyncio.run(scenario())
    assert (first.error.code, first.error.field) == (INVALID, "request_id")
    assert "already in flight" in first.error.message
    assert not second.HasField("error")


_UNREAD_BOUNDS = ["MAX_UNREAD_REPLIES", "MAX_UNREAD_BYTES", "MAX_UNREAD_BYTES_ALL_STREAMS"]
_BULKY = pb.RolloutRequest(request_id="x" * 1000, prompt_ids=[7] * 100_000)  # no params
_SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]  # the client's window stays at 64 KiB


async def _write_without_reading(call, sent: list[int], limit: int = 600) -> None:
    while sent[0] < limit:
        await call.write(_BULKY)
        sent[0] += 1


@pytest.mark.parametrize("bound", _UNREAD_BOUNDS)
def test_a_client_that_never_reads_its_replies_is_held_back(tmp_path, tok_dir, monkeypatch,
                                                           bound):
    # Invalid requests were answered into an unbounded per-stream queue, each echoing its
    # request_id (1 MB ones grew the server by 620 MB over 600 requests). Now the echo is at
    # most 256 characters, and once the client's receive window is full and MAX_UNREAD_REPLIES
    # replies, or MAX_UNREAD_BYTES of them (on the stream, or on all streams together), wait,
    # the server stops reading the stream, so the client's writes block. (Replies may be up to
    # max_message_mb each: a count alone let 256 of them wait.)
    for name in _UNREAD_BOUNDS:  # only the bound under test binds
        monkeypatch.setattr(service, name, 10**9)
    monkeypatch.setattr(service, bound, 8 if bound == "MAX_UNREAD_REPLIES" else 8 * 300)

    async def scenario():
        async with serving(tmp_path, tok_dir, channel_factory=lambda t: grpc.aio.insecure_channel(
                t, options=_SMALL_WINDOW)) as h:
            call = h.stub.Rollout()
            sent = [0]
            writing = asyncio.create_task(_write_without_reading(call, sent))
            await asyncio.wait({writing}, timeout=3.0)  # 600 x 100 KB unhindered: well under
            held_at = sent[0]
            first = await call.read()
            call.cancel()
            await asyncio.gather(writing, return_exceptions=True)
            await asyncio.sleep(0.1)  # the stream's end reaches the server
            return held_at, first, h.server.servicer._unsent.bytes

    sent, first, unsent_after = asyncio.run(scenario())
    assert 8 <= sent < 600, sent
    assert (first.error.field, first.request_id) == ("request_id", "x" * 256)
    assert first.error.message == "request_id: 1000 characters, at most 256"
    assert unsent_after == 0  # a closed stream's replies no longer count


def test_a_client_that_reads_is_not_held_back_by_one_that_does_not(tmp_path, tok_dir,
                                                                   monkeypatch):
    # Each stream's bound alone let N streams hold N x 256 MiB of unsent replies; the bound on
    # all streams together holds back only the streams that have replies waiting.
    for name in _UNREAD_BOUNDS:
        monkeypatch.setattr(service, name, 10**9)
    monkeypatch.setattr(service, "MAX_UNREAD_BYTES_ALL_STREAMS", 8 * 300)

    async def scenario():
        async with serving(tmp_path, tok_dir, channel_factory=lambda t: grpc.aio.insecure_channel(
                t, options=_SMALL_WINDOW)) as h:
            stuck, sent = h.stub.Rollout(), [0]
            writing = asyncio.create_task(_write_without_reading(stuck, sent))
            await asyncio.wait({writing}, timeout=3.0)
            held_at = sent[0]
            unsent = h.server.servicer._unsent.bytes
            # another client, reading its replies, gets every one of them meanwhile
            replies = await asyncio.wait_for(rollout(h.stub, [
                rollout_request(f"r{i}", prompt="1+1=") for i in range(20)]), 30)
            stuck.cancel()
            await asyncio.gather(writing, return_exceptions=True)
            return held_at, unsent, replies

    held_at, unsent, replies = asyncio.run(scenario())
    assert held_at < 600 and unsent >= 8 * 300
    assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(20))
    assert not any(r.HasField("error") for r in replies)


def test_streams_past_max_rollout_streams_are_refused(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir, max_rollout_streams=2) as h:
            first, second = h.stub.Rollout(), h.stub.Rollout()
            for call in (first, second):
                await call.write(rollout_request(f"open-{id(call)}", prompt="1+1="))
                await call.read()  # the server has the stream open
            third = h.stub.Rollout()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.read()
            first.cancel()
            await asyncio.sleep(0.1)
            after = await rollout(h.stub, [rollout_request("again", prompt="1+1=")])
            second.cancel()
            return refused.value, after

    refused, (after,) = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_rollout_streams (2)" in refused.details()
    assert not after.HasField("error")  # a stream closed makes room


def test_generate_streams_tokens_then_the_finish_reason(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            params = pb.SamplingParams(max_new_tokens=8, greedy=True)
            req = pb.GenerateRequest(
                request_id="g", prompt_ids=encode("5+5="), sampling_params=params
            )
            chunks = [c async for c in h.stub.Generate(req)]
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            bad_params = pb.SamplingParams(max_new_tokens=4, top_k=-5)
            bad = pb.GenerateRequest(
                request_id="g2", prompt_ids=encode("1"), sampling_params=bad_params
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in h.stub.Generate(bad):
                    pass
            return chunks, status, err.value

    chunks, status, err = asyncio.run(scenario())
    assert [t for c in chunks for t in c.token_ids] == encode("10") + [EOS_ID]
    assert [c.finish_reason for c in chunks] == [0, 0, pb.FINISH_REASON_STOP]
    assert [v for c in chunks for v in c.versions] == [0, 0, 0]
    assert status.tokens_generated == 3
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("sampling_params.top_k: ")


def test_auth_token_is_required_except_for_health(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir, auth_token="s3cret") as h:
            outcomes = {}
            for label, metadata in [
                ("missing", None),
                ("wrong", (("authorization", "Bearer nope"),)),
                ("right", (("authorization", "Bearer s3cret"),)),
                # the last of several counted: a wrong token followed by the right one passed
                ("twice", (("authorization", "Bearer nope"), ("authorization", "Bearer s3cret"))),
            ]:
                try:
                    await h.stub.GetStatus(pb.GetStatusRequest(), metadata=metadata)
                    outcomes[label] = "ok"
                except grpc.aio.AioRpcError as e:
                    outcomes[label] = e.code()
            with pytest.raises(grpc.aio.AioRpcError) as stream_err:
                await rollout(h.stub, [rollout_request("x")])
            token = (("authorization", "Bearer s3cret"),)
            ok = await rollout(h.stub, [rollout_request("y")], token)
            health = health_pb2_grpc.HealthStub(h.channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
            return outcomes, stream_err.value.code(), ok, answer.status

    outcomes, stream_code, ok, health_status = asyncio.run(scenario())
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert outcomes == {"missing": unauthenticated, "wrong": unauthenticated, "right": "ok",
                        "twice": unauthenticated}
    assert stream_code == unauthenticated
    assert len(ok[0].trajectories) == 2
    assert health_status == health_pb2.HealthCheckResponse.SERVING


def test_health_watch_streams_without_the_token_are_bounded(tmp_path, tok_dir):
    # The health service answers without the token: tokenless Watch streams, one per service
    # name, grew the server's memory without bound (20,000 of them: +470 MiB).
    from rollout.health import MAX_WATCHERS

    async def scenario():
        async with serving(tmp_path, tok_dir, auth_token="s3cret") as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(service=f"s{i}"))
                       for i in range(MAX_WATCHERS)]
            first = [await w.read() for w in watches]  # each open, answering
            extra = health.Watch(health_pb2.HealthCheckRequest(service=""))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            watches.pop().cancel()
            await asyncio.sleep(0.2)
            again = health.Watch(health_pb2.HealthCheckRequest(service=""))
            admitted = await again.read()
            for w in [*watches, again]:
                w.cancel()
            return first, refused.value, admitted

    first, refused, admitted = asyncio.run(scenario())
    unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    assert [r.status for r in first] == [unknown] * MAX_WATCHERS
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_WATCHERS} health Watch streams open" in refused.details()
    assert admitted.status == health_pb2.HealthCheckResponse.SERVING


def test_token_can_come_from_the_environment(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setenv("ROLLOUT_TEST_TOKEN", "from-env")
    config = server_config(tmp_path, tok_dir, auth_token_env="ROLLOUT_TEST_TOKEN")
    assert config.resolve_auth_token() == "from-env"
    monkeypatch.delenv("ROLLOUT_TEST_TOKEN")
    with pytest.raises(ConfigError, match="auth_token_env: .* ROLLOUT_TEST_TOKEN is unset"):
        config.resolve_auth_token()


def test_health_and_reflection_answer(tmp_path, tok_dir):
    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
            ours = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            refl = reflection_pb2_grpc.ServerReflectionStub(h.channel)
            call = refl.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
            await call.write(symbol)
            await call.done_writing()
            answers = [a async for a in call]
            return overall.status, ours.status, answers

    overall, ours, (listing, files) = asyncio.run(scenario())
    assert overall == ours == health_pb2.HealthCheckResponse.SERVING
    services = {s.name for s in listing.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    assert files.file_descriptor_response.file_descriptor_proto  # the rollout.proto descriptor


def test_pause_holds_generation_until_resume(tmp_path, tok_dir):
    async def scenario():
        engine = ArithmeticEngine(step_s=0.005)
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            paused = await h.stub.Pause(pb.PauseRequest())
            call = h.stub.Rollout()
            await call.write(rollout_request("p", group_size=2))
            await call.done_writing()
            await until(lambda: engine.active == 2)
            await asyncio.sleep(0.05)
            during = await h.stub.GetStatus(pb.GetStatusRequest())
            resumed = await h.stub.Resume(pb.ResumeRequest())
            responses = [r async for r in call]
            after = await h.stub.GetStatus(pb.GetStatusRequest())
            return paused, during, resumed, responses, after

    paused, during, resumed, responses, after = asyncio.run(scenario())
    assert paused.paused and not resumed.paused
    assert (during.running_requests, during.tokens_generated) == (1, 0)
    assert during.engine_stats["active_sequences"] == 2.0
    assert len(responses[0].trajectories) == 2
    assert (after.running_requests, after.queued_requests, after.tokens_generated) == (0, 0, 6)
    assert after.tokens_per_second > 0
    assert (after.engine_kind, after.vocab_size, after.max_context_len) == ("arithmetic", 42, 64)


def test_full_queue_stops_reading_until_slots_free(tmp_path, tok_dir):
    async def scenario():
        async with serving(
            tmp_path, tok_dir, max_concurrent_groups=1, max_queued_requests=1
        ) as h:
            await h.stub.Pause(pb.PauseRequest())
            call = h.stub.Rollout()
            for i in range(4):
                await call.write(rollout_request(f"r{i}"))
            await until(lambda: h.engine.active == 2)  # the running group's two samples
            await asyncio.sleep(0.05)
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            await h.stub.Resume(pb.ResumeRequest())
            await call.done_writing()
            return status, [r async for r in call]

    status, responses = asyncio.run(scenario())
    assert (status.running_requests, status.queued_requests) == (1, 1)
    assert sorted(r.request_id for r in responses) == ["r0", "r1", "r2", "r3"]
    assert all(len(r.trajectories) == 2 for r in responses)


def test_update_weights_reaches_the_engine_and_failures_keep_the_version(tmp_path, tok_dir):
    good = write_checkpoint(tmp_path / "ckpt1", "one")
    broken = tmp_path / "broken"
    broken.mkdir()

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            ok = await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(good), version=1))
            errors = []
            attempts = [(str(broken), 2), (str(tmp_path / "none"), 2), (str(good), 1), ("", 3),
                        (str(good), 2**31), ("/a\0b", 3)]
            for path, version in attempts:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=path, version=version))
                errors.append((err.value.code(), err.value.details()))
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            return ok, errors, status, h.engine.loaded

    ok, errors, status, loaded = asyncio.run(scenario())
    assert ok.version == 1 and ok.load_s >= 0
    assert [(p, v) for p, v, _ in loaded] == [(str(good), 1)]
    failed = grpc.StatusCode.FAILED_PRECONDITION
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert [code for code, _ in errors] == [failed, failed, failed, invalid, invalid, invalid]
    assert errors[0][1].startswith("path: cannot load")
    assert errors[2][1].startswith("version: 1 is not newer than the serving version 1")
    assert errors[3][1].startswith("path: ")
    # Every token records its version as an int32: a larger one broke every later request.
    assert errors[4][1] == "version: must be in [0, 2147483647], got 2147483648"
    assert errors[5][1] == "path: contains a NUL character"
    assert status.version == 1


def test_a_server_serving_one_run_refuses_weights_from_another_while_its_trainer_is_around(
        tmp_path, tok_dir):
    # Two runs pointed at one server (a shared addresses file, a second run started by mistake,
    # an evaluation): before, each forced its weights in and trained on samples of the other.
    from areal_jax.controller.rollout_pool import WeightsRejectedError

    one, two = write_checkpoint(tmp_path / "one", "one"), write_checkpoint(tmp_path / "two", "two")

    async def gone(pool):  # as if its process died: streams cut, no Release
        pool._run_id = None
        await pool.close()

    async def scenario():
        async with serving(tmp_path, tok_dir, run_lease_s=0.5) as h:
            address = f"127.0.0.1:{h.server.port}"
            run_a, run_b = (RolloutPool([address], run_id=r) for r in ("run-a", "run-b"))
            await run_a.start()
            await run_a.update_weights(one, 1)
            await run_b.start()
            refused = []
            for push in (False, True):
                with pytest.raises(WeightsRejectedError) as err:
                    await run_b.update_weights(two, 2, push=push, force=True)
                refused.append(str(err.value))
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(two), version=5))
            with pytest.raises(grpc.aio.AioRpcError) as malformed:
                await h.stub.GetStatus(pb.GetStatusRequest(), metadata=(("areal-run", "x" * 200),))
            owner = (await h.stub.GetStatus(pb.GetStatusRequest())).run_id
            await gone(run_a)
            resumed = RolloutPool([address], run_id="run-a")  # its trainer restarted
            await resumed.start()
            await resumed.update_weights(one, 3)
            await gone(resumed)
            with pytest.raises(WeightsRejectedError, match="was heard from 0 s ago"):
                await run_b.update_weights(two, 4)
            await asyncio.sleep(0.8)  # run-a's trainer gone for longer than run_lease_s
            await run_b.update_weights(two, 4)
            taken_over = (await h.stub.GetStatus(pb.GetStatusRequest())).run_id
            await run_b.close()  # done with the server: says so
            released = (await h.stub.GetStatus(pb.GetStatusRequest())).run_id
            run_c = RolloutPool([address], run_id="run-c")
            await run_c.start()
            await run_c.update_weights(one, 5)  # at once
            await run_c.close()
            return (refused, anonymous.value, malformed.value.code(), owner, taken_over, released,
                    [(Path(p).name, v) for p, v, _ in h.engine.loaded])

    (refused, anonymous, malformed, owner, taken_over, released,
     loaded) = asyncio.run(scenario())
    for message in refused:  # by path and by push, the push refused before its bytes
        assert "FAILED_PRECONDITION" in message and "serves run 'run-a'" in message
        assert "has a stream open" in message
    assert anonymous.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "a client naming no run may load weights once" in anonymous.details()
    assert malformed == grpc.StatusCode.INVALID_ARGUMENT
    assert (owner, taken_over, released) == ("run-a", "run-b", "")
    assert [v for _, v in loaded] == [1, 3, 4, 5]


def test_pause_and_resume_are_the_serving_run_s_alone(tmp_path, tok_dir):
    # Any token holder could pause a run's servers, or lift the pause of a synchronous run's.
    one = write_checkpoint(tmp_path / "one", "one")

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            address = f"127.0.0.1:{h.server.port}"
            run_a = RolloutPool([address], run_id="run-a")
            await run_a.start()
            await run_a.update_weights(one, 1)  # the server serves run-a now
            await run_a.pause()
            outcomes = []
            for call, run in ((h.stub.Resume, "run-b"), (h.stub.Pause, "run-b"),
                              (h.stub.Resume, "run-a")):
                try:
                    await call(pb.ResumeRequest() if call == h.stub.Resume
                               else pb.PauseRequest(), metadata=(("areal-run", run),))
                    outcomes.append(("ok", h.engine.paused))
                except grpc.aio.AioRpcError as e:
                    outcomes.append((e.code(), h.engine.paused))
            await run_a.close()
            return outcomes

    refused = grpc.StatusCode.FAILED_PRECONDITION
    assert asyncio.run(scenario()) == [(refused, True), (refused, True), ("ok", False)]


def test_a_generate_call_of_the_serving_run_holds_its_lease_while_it_runs(tmp_path, tok_dir):
    from areal_jax.controller.rollout_pool import WeightsRejectedError

    one = write_checkpoint(tmp_path / "one", "one")

    async def scenario():
        engine = ArithmeticEngine(step_s=0.02)
        async with serving(tmp_path, tok_dir, engine=engine, run_lease_s=0.3) as h:
            address = f"127.0.0.1:{h.server.port}"
            run_a, run_b = (RolloutPool([address], run_id=r) for r in ("run-a", "run-b"))
            await run_a.start()
            await run_a.update_weights(one, 1)
            run_a._run_id = None  # its streams cut without a Release
            await run_a.close()
            params = pb.SamplingParams(max_new_tokens=60)  # about 1.2 s
            generate = h.stub.Generate(pb.GenerateRequest(
                request_id="g", prompt_ids=encode("x"), sampling_params=params),
                metadata=(("areal-run", "run-a"),))
            await until(lambda: engine.tokens >= 2)
            await asyncio.sleep(0.6)  # past run_lease_s since its last call began
            await run_b.start()
            with pytest.raises(WeightsRejectedError, match="has a stream open"):
                await run_b.update_weights(one, 2)
            chunks = [c async for c in generate]
            await asyncio.sleep(0.5)
            await run_b.update_weights(one, 2)
            await run_b.close()
            return chunks[-1].finish_reason

    assert asyncio.run(scenario()) == pb.FINISH_REASON_LENGTH


def test_a_run_lease_runs_from_the_last_sign_of_its_trainer():
    from rollout.run_lease import RunLease

    now = [0.0]
    lease = RunLease(30.0, clock=lambda: now[0])
    assert lease.refusal("b") is None  # nothing served yet
    lease.loaded("a")
    lease.stream_opened("a")
    now[0] = 1000.0
    assert "has a stream open" in lease.refusal("b") and lease.refusal("a") is None
    lease.stream_closed("a")
    now[0] = 1029.0
    assert "heard from 29 s ago" in lease.refusal("b")
    lease.heard("a")  # a status call, say
    now[0] = 1058.0
    assert lease.refusal("b") is not None and lease.refusal("") is not None
    now[0] = 1059.5
    assert lease.refusal("b") is None
    lease.loaded("")  # weights of no named run: anyone may load next
    assert lease.refusal("b") is None and lease.idle_s() == float("inf")


def test_a_relative_weights_path_reaches_the_server_absolute(tmp_path, tok_dir, monkeypatch):
    # A trainer started with a relative run_dir sent runs/x/exports/v000000 as written; a
    # server started elsewhere looked for it under its own directory and refused it.
    write_checkpoint(tmp_path / "runs" / "one", "one")
    monkeypatch.chdir(tmp_path)

    async def scenario():
        async with serving(tmp_path, tok_dir, weights_allowed_roots=[str(tmp_path)]) as h:
            pool = RolloutPool([f"127.0.0.1:{h.server.port}"])
            await pool.start()
            try:
                await pool.update_weights(Path("runs") / "one", 1)
            finally:
                await pool.close()
            return [p for p, _, _ in h.engine.loaded]

    assert asyncio.run(scenario()) == [str(tmp_path / "runs" / "one")]


def test_push_weights_writes_the_files_and_loads_that_directory(tmp_path, tok_dir):
    first = write_checkpoint(tmp_path / "src1", "first")
    second = write_checkpoint(tmp_path / "src2", "second")

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            one = await h.stub.PushWeights(push_weight_requests(first, 1, chunk_bytes=333))
            first_dir = h.engine.loaded[-1][0]
            kept_after_first = os.path.isdir(first_dir)
            two = await h.stub.PushWeights(push_weight_requests(second, 2, chunk_bytes=4096))
            return (one, two, first_dir, kept_after_first, h.engine.loaded, h.push_dir,
                    h.pushed())

    one, two, first_dir, kept_after_first, loaded, push_dir, left = asyncio.run(scenario())
    assert (one.version, two.version) == (1, 2)
    assert push_dir.parent == tmp_path / "push"
    for (path, version, files), src in zip(loaded, [first, second], strict=True):
        assert os.path.dirname(path) == str(push_dir)
        assert files == {p.name: p.read_bytes() for p in src.iterdir()}
    # the previous pushed checkpoint is removed once the next one is loaded
    assert kept_after_first and not os.path.exists(first_dir)
    assert left == [os.path.basename(loaded[1][0])]


def test_force_takes_the_server_back_to_an_older_version(tmp_path, tok_dir):
    old = write_checkpoint(tmp_path / "old", "old")
    pushed = write_checkpoint(tmp_path / "pushed", "pushed")
    engine = ArithmeticEngine(step_s=0.01, version=5)

    async def scenario():
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(old), version=2))
            call = h.stub.Rollout()
            await call.write(rollout_request("long", prompt="none", group_size=1,
                                             max_new_tokens=30))
            await call.done_writing()
            await until(lambda: engine.tokens >= 5)
            forced = await h.stub.UpdateWeights(
                pb.UpdateWeightsRequest(path=str(old), version=2, force=True)
            )
            (group,) = [r async for r in call]
            same = await h.stub.PushWeights(push_weight_requests(pushed, 2, force=True))
            zero = await h.stub.UpdateWeights(
                pb.UpdateWeightsRequest(path=str(old), version=0, force=True)
            )
            return refused.value, forced, group, same, zero

    refused, forced, group, same, zero = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "2 is not newer than the serving version 5" in refused.details()
    assert (forced.version, same.version, zero.version) == (2, 2, 0)
    versions = list(group.trajectories[0].versions)
    switch = versions.index(2)
    assert 0 < switch < 30 and versions == [5] * switch + [2] * (30 - switch)
    assert [(v, files["config.json"]) for _, v, files in engine.loaded] == [
        (2, b'{"marker": "old"}'), (2, b'{"marker": "pushed"}'), (0, b'{"marker": "old"}'),
    ]


def test_update_weights_loads_only_under_the_allowed_roots(tmp_path, tok_dir, tmp_path_factory):
    outside = write_checkpoint(tmp_path_factory.mktemp("elsewhere") / "ckpt", "outside")
    inside = write_checkpoint(tmp_path / "ckpt", "inside")
    (tmp_path / "link").symlink_to(outside)

    async def attempt(h, path, version):
        try:
            reply = await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=path, version=version))
            return reply.version
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:  # default: push dir and the model's parent
            default = [await attempt(h, p, v) for p, v in
                       [(str(outside), 1), (str(tmp_path / "link"), 1), (str(inside), 1)]]
        roots = {"weights_allowed_roots": [str(outside.parent)]}
        async with serving(tmp_path, tok_dir, **roots) as h:
            configured = [await attempt(h, str(inside), 1), await attempt(h, str(outside), 2)]
            # quoted back whole (twice), a long path's status was over the client's limit on
            # trailers: RESOURCE_EXHAUSTED "Stream removed", naming no field
            configured.append(await attempt(h, "/nope/" + "a" * 9000, 3))
        # A link into a root loads what it led to when checked (the engine is given the real
        # path: a link changed between the check and the load cannot lead elsewhere).
        (tmp_path / "inside_link").symlink_to(inside)
        async with serving(tmp_path, tok_dir) as h:
            assert await attempt(h, str(tmp_path / "inside_link"), 3) == 3
            assert h.engine.loaded[-1][0] == str(inside)
        return default, configured

    (out, link, ok), (inside_refused, outside_ok, long) = asyncio.run(scenario())
    assert long[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert long[1].startswith("path: /nope/" + "a" * 194 + "... (9006 characters) (real path ")
    for code, details in (out, link, inside_refused, long):
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert details.startswith("path: ") and "is not under weights_allowed_roots" in details
    assert f"real path {outside}" in link[1]
    assert ok == 1 and outside_ok == 2


def test_a_model_at_the_filesystem_root_does_not_open_every_path():
    # model_path /model (a container's mount) made its parent, /, a default root: UpdateWeights
    # could load any directory on the host.
    config = EngineConfig(model_path="/model")
    roots = ServerConfig(engine=config).allowed_weight_roots("/tmp/push")
    assert roots == [os.path.realpath("/tmp/push"), "/model"]
    nested = ServerConfig(engine=EngineConfig(model_path="/models/m")).allowed_weight_roots("/p")
    assert nested == ["/p", "/models"]


def test_a_remote_host_needs_a_token_or_an_explicit_opt_out(tmp_path, tok_dir, caplog):
    with pytest.raises(ConfigError, match="host: 0.0.0.0 is reachable from other machines"):
        server_config(tmp_path, tok_dir, host="0.0.0.0")
    server_config(tmp_path, tok_dir, host="0.0.0.0", auth_token="s3cret")
    server_config(tmp_path, tok_dir, host="::1")
    server_config(tmp_path, tok_dir, host="localhost")
    assert not caplog.records
    server_config(tmp_path, tok_dir, host="10.1.2.3", allow_insecure_remote=True)
    assert "INSECURE" in caplog.text


def _bad_pushes(src):
    good = list(push_weight_requests(src, 1, chunk_bytes=500))
    header_first = good[0]
    short = [header_first] + good[1:-1]  # last chunk missing
    renamed = pb.PushWeightsRequest()
    renamed.CopyFrom(header_first)
    renamed.header.files[0].name = "../escape.json"
    skipped = [header_first, good[1], good[3]]  # a file's second chunk before its first
    return [
        ("header", good[1:]),
        ("header.files", [pb.PushWeightsRequest(header=pb.WeightsHeader(version=1))]),
        ("header.files[1].size", short),
        ("header.files[0].name", [renamed] + good[1:]),
        ("chunk.offset", skipped),
        ("header", [header_first, header_first]),
        ("header.version", [pb.PushWeightsRequest(header=pb.WeightsHeader(version=2**31))]),
        # A name past NAME_MAX failed as a disk error; a header of millions of files made as
        # many empty files.
        ("header.files[0].name", [pb.PushWeightsRequest(header=pb.WeightsHeader(
            version=1, files=[pb.WeightFile(name="w" * 300, size=1)]))]),
        ("header.files", [pb.PushWeightsRequest(header=pb.WeightsHeader(
            version=1, files=[pb.WeightFile(name=f"f{i}", size=0) for i in range(5000)]))]),
        # Empty chunks kept a stalled push alive past push_idle_timeout_s, holding the update
        # lock: every update queued behind it waited.
        ("chunk.data", [header_first, pb.PushWeightsRequest(
            chunk=pb.FileChunk(name=header_first.header.files[0].name, offset=0))]),
        # Pickled weights, which an engine loading "auto" might read: never received.
        ("header.files[1].name", [pb.PushWeightsRequest(header=pb.WeightsHeader(
            version=1, files=[pb.WeightFile(name="config.json", size=2),
                              pb.WeightFile(name="pytorch_model.bin", size=1)]))]),
    ]


def test_bad_pushes_are_rejected_and_leave_nothing_behind(tmp_path, tok_dir):
    src = write_checkpoint(tmp_path / "src", "x")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "weights.safetensors").write_bytes(b"\0" * 10)

    async def scenario():
        results = []
        async with serving(tmp_path, tok_dir) as h:
            for field, requests in _bad_pushes(src):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.stub.PushWeights(iter(requests))
                results.append((field, err.value.code(), err.value.details()))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.PushWeights(push_weight_requests(no_config, 1))
            results.append(("load", err.value.code(), err.value.details()))
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            left = h.pushed()
        return results, status, left

    results, status, left = asyncio.run(scenario())
    for field, code, details in results[:-1]:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, details)
        assert details.startswith(f"{field}: "), (field, details)
    assert results[-1][1] == grpc.StatusCode.FAILED_PRECONDITION
    assert status.version == 0
    assert left == []


def test_a_push_the_server_cannot_write_is_logged_there_and_answered_as_its_fault(
        tmp_path, tok_dir, caplog):
    """The push directory replaced by a file: the server's log said nothing, and the answer
    was RESOURCE_EXHAUSTED for 'File exists'. A full disk keeps RESOURCE_EXHAUSTED."""
    src = write_checkpoint(tmp_path / "src", "x")

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            shutil.rmtree(h.push_dir, ignore_errors=True)
            h.push_dir.write_text("not a directory")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.PushWeights(push_weight_requests(src, 1))
            status = await h.stub.GetStatus(pb.GetStatusRequest())
        return err.value, status

    error, status = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details().startswith("writing weights: ")
    assert status.version == 0  # the old weights serve on
    assert "a weights push failed (INTERNAL): writing weights: " in caplog.text
    from rollout.service import _push_failure

    assert _push_failure(OSError(28, "No space left on device"))[0] == (
        grpc.StatusCode.RESOURCE_EXHAUSTED)


def _update_beside(h, push_requests, good):
    """Start a push of ``push_requests``, then load ``good`` by path as version 2 while it
    runs: (version served, seconds the update took, the push's error)."""
    async def run():
        push = asyncio.ensure_future(h.stub.PushWeights(push_requests))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        update = await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(good), version=2))
        waited = time.monotonic() - start
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push
        return update.version, waited, err.value
    return run()


def test_a_stalled_push_ends_at_its_idle_timeout_and_holds_no_update_back(tmp_path, tok_dir):
    # A client that sent the header and nothing more held the server's update lock for good.
    src = write_checkpoint(tmp_path / "src", "x")
    good = write_checkpoint(tmp_path / "good", "good")

    async def stalled():
        yield next(iter(push_weight_requests(src, 3)))
        await asyncio.sleep(60)

    async def scenario():
        async with serving(tmp_path, tok_dir, push_idle_timeout_s=2) as h:
            return *(await _update_beside(h, stalled(), good)), h.pushed()

    version, waited, error, left = asyncio.run(scenario())
    assert version == 2 and waited < 1.5
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == "the push sent nothing for 2 s (push_idle_timeout_s)"
    assert left == []


def test_a_trickling_push_ends_at_its_deadline_and_holds_no_update_back(tmp_path, tok_dir):
    # A client that sent a few bytes just inside each idle period held the update lock for as
    # long as it went on: every update behind it waited (the path update here, 60 s of it).
    src = write_checkpoint(tmp_path / "src", "x")
    good = write_checkpoint(tmp_path / "good", "good")
    requests = list(push_weight_requests(src, 3, chunk_bytes=4))
    size = sum(f.size for f in requests[0].header.files)

    async def trickle():
        for request in requests:
            yield request
            await asyncio.sleep(0.2)

    async def scenario():
        # Deadline: 1 s idle + size at size bytes/s = 2 s; the stream would take 0.2 s a chunk,
        # far longer. What it sends after the deadline is read (and dropped) for PUSH_DRAIN_S
        # before the status goes back: a status sent mid-stream reached the client as INTERNAL.
        async with serving(tmp_path, tok_dir, push_idle_timeout_s=1,
                           push_min_mib_per_s=size / 2**20) as h:
            start = time.monotonic()
            result = await _update_beside(h, trickle(), good)
            return *result, time.monotonic() - start, h.pushed()

    assert len(requests) * 0.2 > 8
    version, waited, error, took, left = asyncio.run(scenario())
    assert version == 2 and waited < 1.5
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert error.details().startswith("the push was not complete within 1 s plus its size at")
    assert 1.9 + PUSH_DRAIN_S <= took < 8, took
    assert left == []


def test_pushes_in_progress_reserve_the_disk_space_they_announce(tmp_path, monkeypatch):
    # Each push checked its size against the free space alone: streams received side by side
    # could each pass the check and together fill the disk.
    src = write_checkpoint(tmp_path / "src", "x")
    requests = list(push_weight_requests(src, 1, chunk_bytes=100))
    size = sum(f.size for f in requests[0].header.files)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(weight_intake.shutil, "disk_usage",
                        lambda _: usage._replace(free=size + size // 2))
    intake = weight_intake.WeightIntake(tmp_path / "push")
    first_sent = asyncio.Event()

    async def slow():
        yield requests[0]
        yield requests[1]
        first_sent.set()
        await asyncio.sleep(0.3)
        for request in requests[2:]:
            yield request

    async def plain():
        for request in requests:
            yield request

    async def scenario():
        first = asyncio.ensure_future(intake.receive(PushStream(slow()), lambda h: None))
        await first_sent.wait()
        reserved_midway = intake.reserved
        with pytest.raises(OSError, match="announced by pushes in progress"):
            await intake.receive(PushStream(plain()), lambda h: None)
        directory, _ = await first
        return reserved_midway, directory

    reserved_midway, directory = asyncio.run(scenario())
    assert reserved_midway == size - len(requests[1].chunk.data)
    assert intake.reserved == 0
    assert sorted(os.listdir(directory)) == sorted(os.listdir(src))


class SlowLoadingEngine(ArithmeticEngine):
    """Takes ``load_s`` to load weights; counts the loads running at once."""

    def __init__(self, load_s: float, **kwargs):
        super().__init__(**kwargs)
        self.load_s, self.loading, self.most_loading = load_s, 0, 0

    async def update_weights(self, path, version):
        self.loading += 1
        self.most_loading = max(self.most_loading, self.loading)
        try:
            await asyncio.sleep(self.load_s)
            await super().update_weights(path, version)
        finally:
            self.loading -= 1


def test_an_update_whose_caller_gave_up_loads_to_its_end_before_the_next(tmp_path, tok_dir):
    # A deadline cancelled the update mid-load: the engine's load went on (SGLang's, a JAX
    # engine's thread) or stopped half way, unrecorded, and the next update started beside it;
    # a push's directory was deleted while the engine still read it.
    first = write_checkpoint(tmp_path / "first", "first")
    second = write_checkpoint(tmp_path / "second", "second")
    pushed = write_checkpoint(tmp_path / "pushed", "pushed")
    engine = SlowLoadingEngine(load_s=2.0)  # each deadline below falls inside a load

    async def scenario():
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(first), version=1),
                                           timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            update = await h.stub.UpdateWeights(
                pb.UpdateWeightsRequest(path=str(second), version=2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.PushWeights(push_weight_requests(pushed, 3), timeout=1.0)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: engine.version == 3)
            return update.version, h.pushed()

    version, left = asyncio.run(scenario())
    assert version == 2 and engine.most_loading == 1
    assert [(Path(path).name, v) for path, v, _ in engine.loaded][:2] == [("first", 1),
                                                                          ("second", 2)]
    assert engine.loaded[2][1] == 3 and engine.loaded[2][2]["config.json"] == \
        (pushed / "config.json").read_bytes()
    assert len(left) == 1  # the push loaded: its directory is the one kept


def test_tokens_after_an_update_carry_the_new_version(tmp_path, tok_dir):
    ckpt = write_checkpoint(tmp_path / "ckpt", "v1")

    async def scenario():
        async with serving(tmp_path, tok_dir, engine=ArithmeticEngine(step_s=0.01)) as h:
            call = h.stub.Rollout()
            req = rollout_request("long", prompt="no sum", group_size=1, max_new_tokens=30)
            await call.write(req)
            await call.done_writing()
            while (await h.stub.GetStatus(pb.GetStatusRequest())).tokens_generated < 5:
                await asyncio.sleep(0.005)
            await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(ckpt), version=1))
            return [r async for r in call]

    (response,) = asyncio.run(scenario())
    versions = list(response.trajectories[0].versions)
    assert len(versions) == 30
    switch = versions.index(1)
    assert 0 < switch < 30 and versions == [0] * switch + [1] * (30 - switch)


ABORTED = grpc.StatusCode.ABORTED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def test_a_group_cancelled_before_it_ran_gives_its_admission_place_back(tmp_path, tok_dir):
    # A client gone right after sending: its group's job was cancelled before its first step,
    # so the code giving its place back never ran; two such streams and a server admitting
    # one queued and one running group admitted nothing more, for good.
    async def scenario():
        async with serving(tmp_path, tok_dir, max_concurrent_groups=1,
                           max_queued_requests=1) as h:
            servicer, admission = h.server.servicer, h.server.servicer._admission
            for i in range(3):
                tasks: set[asyncio.Task] = set()

                async def requests():
                    yield rollout_request(f"r{i}")
                    for job in tasks:  # the stream ends before the job's first step
                        job.cancel()

                replies = service._Replies(service._Unsent())
                await asyncio.wait_for(servicer._read(requests(), replies, tasks), 5)
                await asyncio.sleep(0)  # the jobs' done callbacks
                assert (admission.queued, admission.running) == (0, 0), i
            groups = await rollout(h.stub, [rollout_request("after", prompt="1+1=")])
            return groups

    (group,) = asyncio.run(scenario())
    assert group.request_id == "after" and not group.HasField("error")


def test_non_finite_log_probs_are_an_error_not_a_result(tmp_path, tok_dir, caplog):
    # Finite weights that overflow in the forward pass load; their NaN log-probs came back in
    # groups marked successful, and in Generate chunks.
    from rollout.engine import GenerationChunk

    class Overflowing(ArithmeticEngine):
        async def generate(self, prompt_ids, params, request_id):
            async for chunk in super().generate(prompt_ids, params, request_id):
                yield GenerationChunk(chunk.token_ids, (float("nan"),) * len(chunk.logprobs),
                                      chunk.versions, chunk.finish_reason)

    async def scenario():
        async with serving(tmp_path, tok_dir, engine=Overflowing()) as h:
            groups = await rollout(h.stub, [rollout_request("a"), rollout_request("b")])
            params = pb.SamplingParams(max_new_tokens=4)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in h.stub.Generate(pb.GenerateRequest(
                        request_id="g", prompt_ids=encode("1+1="), sampling_params=params)):
                    pass
            return groups, err.value

    groups, err = asyncio.run(scenario())
    message = ("the served weights (version 0) gave a non-finite log-prob (weights that "
               "overflow in the forward pass, most likely)")
    assert [(g.error.code, g.error.message) for g in groups] == [
        (grpc.StatusCode.INTERNAL.value[0], message)] * 2
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, message)
    assert caplog.text.count("gave a non-finite log-prob") == 1  # once per version


def test_only_generated_tokens_log_probs_must_be_finite():
    # A workflow may give the tokens it inserts any log-prob (they are not trained on).
    from areal_jax.trajectory import Trajectory, TrajectoryGroup
    from rollout.service import _check_group, _NonFinite
    from rollout.workflows.base import RolloutTask

    task = RolloutTask(request_id="r", prompt_ids=(5, 6), metadata={}, reward_name="exact",
                       group_size=1, sampling=SamplingParams(4))
    nan = float("nan")

    def group(logprobs, mask):
        return TrajectoryGroup("r", [Trajectory([5, 6], [7, 8, 9], logprobs, [3, 4, 5],
                                                output_mask=mask)])

    _check_group(group([-1.0, nan, -1.0], [1, 0, 1]), task)
    with pytest.raises(_NonFinite, match=r"\(version 5\) gave a non-finite log-prob"):
        _check_group(group([-1.0, nan, nan], [1, 0, 1]), task)


def test_a_withdrawn_request_stops_generating_and_nothing_comes_back_for_it(tmp_path, tok_dir):
    # A trainer done with a group (its run ended) withdraws it: the engine stops on it at once,
    # its admission place is free, and the stream goes on with the next request.
    async def scenario():
        engine = ArithmeticEngine(step_s=0.01)
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            call = h.stub.Rollout()
            await call.write(rollout_request("long", prompt="none", max_new_tokens=50))
            await until(lambda: engine.tokens >= 4)
            await call.write(pb.RolloutRequest(request_id="long", cancel=True))
            await call.write(pb.RolloutRequest(request_id="unknown", cancel=True))
            await until(lambda: engine.active == 0)
            tokens_at_cancel = engine.tokens
            await call.write(rollout_request("after", prompt="1+1=", temperature=0.0))
            await call.done_writing()
            replies = [r async for r in call]
            admission = h.server.servicer._admission
            return replies, tokens_at_cancel, (admission.queued, admission.running)

    replies, tokens_at_cancel, held = asyncio.run(scenario())
    assert [r.request_id for r in replies] == ["after"] and not replies[0].HasField("error")
    assert tokens_at_cancel < 2 * 50 // 2  # two samples of 50 tokens each: stopped early
    assert held == (0, 0)


def test_stop_returns_unfinished_groups_as_aborted_errors(tmp_path, tok_dir):
    async def scenario():
        engine = ArithmeticEngine(step_s=0.01)
        async with serving(tmp_path, tok_dir, engine=engine, max_concurrent_groups=1) as h:
            call = h.stub.Rollout()
            await call.write(rollout_request("done", prompt="1+1=", temperature=0.0))
            done = await call.read()
            await call.write(rollout_request("running", prompt="none", max_new_tokens=50))
            await call.write(rollout_request("queued", prompt="none", max_new_tokens=50))
            params = pb.SamplingParams(max_new_tokens=50)
            gen = h.stub.Generate(
                pb.GenerateRequest(request_id="g", prompt_ids=encode("x"), sampling_params=params)
            )
            await until(lambda: engine.tokens >= 10)
            stopping = asyncio.create_task(h.server.stop(grace=5.0))
            responses = [done]
            while (response := await call.read()) is not grpc.aio.EOF:
                responses.append(response)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in gen:
                    pass
            await stopping
            return responses, err.value, engine.closed

    responses, gen_error, closed = asyncio.run(scenario())
    by_id = {r.request_id: r for r in responses}
    assert len(by_id["done"].trajectories) == 2 and not by_id["done"].HasField("error")
    for request_id in ("running", "queued"):  # never partial trajectories
        group = by_id[request_id]
        assert (group.error.code, group.error.message) == (ABORTED, "server shutting down")
        assert not group.trajectories
    assert gen_error.code() == grpc.StatusCode.ABORTED
    assert closed


def test_a_draining_server_finishes_what_it_holds_and_turns_new_work_away(tmp_path, tok_dir):
    async def scenario():
        engine = ArithmeticEngine(step_s=0.01)
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            call = h.stub.Rollout()
            await call.write(rollout_request("held", prompt="none", max_new_tokens=30))
            await until(lambda: engine.tokens >= 4)
            draining = asyncio.create_task(h.server.drain(10.0))
            notice = await call.read()  # told on the open stream at once
            await call.write(rollout_request("late"))
            replies = [notice, await call.read(), await call.read()]
            status = await h.stub.GetStatus(pb.GetStatusRequest())
            answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            new_stream = await rollout(h.stub, [rollout_request("new stream")])
            with pytest.raises(grpc.aio.AioRpcError) as generate:
                params = pb.SamplingParams(max_new_tokens=4)
                async for _ in h.stub.Generate(pb.GenerateRequest(
                        request_id="g", prompt_ids=encode("x"), sampling_params=params)):
                    pass
            drained = await draining
            return (replies, status, answer.status, new_stream, generate.value, drained,
                    [request_id for request_id, _, _ in engine.requests])

    replies, status, health_status, new_stream, generate, drained, ran = asyncio.run(scenario())
    notice, *rest = replies
    assert notice.request_id == "" and notice.error.draining
    assert notice.error.code == UNAVAILABLE
    by_id = {r.request_id: r for r in rest}
    assert by_id["late"].error.draining and by_id["late"].error.code == UNAVAILABLE
    assert len(by_id["held"].trajectories) == 2 and not by_id["held"].HasField("error")
    assert len(ran) == 2 and not any("late" in r for r in ran)  # the late one never ran
    assert status.draining
    assert health_status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert [(g.request_id, g.error.draining) for g in new_stream] == [("", True),
                                                                      ("new stream", True)]
    assert generate.code() == grpc.StatusCode.UNAVAILABLE and "draining" in generate.details()
    assert drained


def test_a_request_waiting_for_a_place_when_the_drain_begins_is_turned_away(tmp_path, tok_dir):
    async def scenario():
        engine = ArithmeticEngine(step_s=0.01)
        async with serving(tmp_path, tok_dir, engine=engine, max_concurrent_groups=1,
                           max_queued_requests=1) as h:
            call = h.stub.Rollout()
            for rid in ("running", "queued", "waiting"):  # the third waits for a place
                await call.write(rollout_request(rid, prompt="none", max_new_tokens=20))
            # Queue and slot taken before the Generate call is made (it could otherwise take
            # the queue place first, and a queued request runs to its end in a drain).
            admission = h.server.servicer._admission
            await until(lambda: admission.queued == admission.running == 1)
            params = pb.SamplingParams(max_new_tokens=4)
            generate = h.stub.Generate(pb.GenerateRequest(  # so does this one
                request_id="waiting-g", prompt_ids=encode("x"), sampling_params=params))
            await until(lambda: engine.tokens >= 2)
            draining = asyncio.create_task(h.server.drain(30.0))
            replies = [await call.read() for _ in range(4)]
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in generate:
                    pass
            assert await draining
            return ({r.request_id: r for r in replies}, {rid for rid, _, _ in engine.requests},
                    refused.value.code())

    by_id, ran, generate_code = asyncio.run(scenario())
    assert by_id[""].error.draining and by_id["waiting"].error.draining
    assert not by_id["running"].HasField("error") and not by_id["queued"].HasField("error")
    assert not any(rid.startswith("waiting") for rid in ran)
    assert generate_code == grpc.StatusCode.UNAVAILABLE


def test_a_drain_longer_than_no_server_timeout_fails_no_waiting_request(tmp_path, tok_dir):
    # The wait for a server starts once the last one has left: a draining server is still
    # there. Before, a request routed nowhere during a long drain failed as soon as it left.
    from areal_jax.controller.rollout_pool import PoolOptions

    async def scenario():
        engine = ArithmeticEngine(step_s=0.05)
        async with serving(tmp_path, tok_dir, engine=engine) as h:
            pool = RolloutPool([f"127.0.0.1:{h.server.port}"], options=PoolOptions(
                rejoin_interval_s=0.1, no_server_timeout_s=1.0))
            await pool.start()
            try:
                held = pool.submit(rollout_request("held", prompt="none", max_new_tokens=40))
                await until(lambda: engine.tokens >= 2)
                draining = asyncio.create_task(h.server.drain(30.0))
                await asyncio.sleep(0.2)
                late = pool.submit(rollout_request("late"))
                group = await held  # about 2 s: twice no_server_timeout_s
                await asyncio.sleep(0.3)
                waiting = not late.done()
                await draining
                return group, waiting, pool.live_servers
            finally:
                await pool.close()

    group, waiting, live = asyncio.run(scenario())
    assert not group.HasField("error") and waiting and live == []


def test_a_pool_starting_against_a_draining_server_says_so(tmp_path, tok_dir):
    from areal_jax.controller.rollout_pool import NoLiveServerError

    async def scenario():
        async with serving(tmp_path, tok_dir) as h:
            h.server.servicer.drain()
            address = f"127.0.0.1:{h.server.port}"
            with pytest.raises(NoLiveServerError) as err:
                await RolloutPool([address]).start(ready_timeout_s=5)
            return str(err.value), address

    message, address = asyncio.run(scenario())
    assert message == ("every rollout server answered that it is draining before it stops: "
                       f"{address}")


def test_engine_death_fails_unfinished_groups_as_unavailable(tmp_path, tok_dir):
    async def scenario():
        engine = ArithmeticEngine(step_s=0.01)
        async with serving(tmp_path, tok_dir, engine=engine, max_concurrent_groups=1) as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            call = h.stub.Rollout()
            await call.write(rollout_request("running", prompt="none", max_new_tokens=50))
            await call.write(rollout_request("queued", prompt="none", max_new_tokens=50))
            await until(lambda: engine.tokens >= 4)
            engine.die("backend unreachable")
            await asyncio.wait_for(h.server.failed.wait(), 5)
            responses = [r async for r in call]
            answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rollout(h.stub, [rollout_request("late")])
            return responses, answer.status, err.value, h.server.failure

    responses, health_status, late, failure = asyncio.run(scenario())
    assert sorted(r.request_id for r in responses) == ["queued", "running"]
    for group in responses:
        assert group.error.code == UNAVAILABLE and not group.trajectories
        assert "backend unreachable" in group.error.message
    assert health_status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert late.code() == grpc.StatusCode.UNAVAILABLE
    assert str(failure) == "backend unreachable"


def _when_serving(action):
    """Run ``action`` in a thread once ``serve`` has installed its SIGTERM handler."""
    original = signal.getsignal(signal.SIGTERM)

    def wait_then_act():
        deadline = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) is original and time.monotonic() < deadline:
            time.sleep(0.01)
        action()

    threading.Thread(target=wait_then_act, daemon=True).start()


def test_serve_exits_nonzero_when_the_engine_dies(tmp_path, tok_dir):
    engine = ArithmeticEngine()
    _when_serving(engine.die)
    config = server_config(tmp_path, tok_dir)
    code = serve(config, engine=engine, scorer=ExactAnswerScorer(), reward_names=("exact",))
    assert code == 1
    assert engine.closed


def test_sigterm_stops_serve_gracefully(tmp_path, tok_dir):
    engine = ArithmeticEngine()
    config = server_config(tmp_path, tok_dir)
    _when_serving(lambda: os.kill(os.getpid(), signal.SIGTERM))
    code = serve(config, engine=engine, scorer=ExactAnswerScorer(), reward_names=("exact",))
    assert code == 0
    assert engine.started and engine.closed


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_only_secure_clients(tmp_path, tok_dir):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())

    async def scenario():
        tls = dict(tls_cert_path=str(cert), tls_key_path=str(key), auth_token="s3cret")
        factory = lambda target: grpc.aio.secure_channel(target, creds)  # noqa: E731
        async with serving(tmp_path, tok_dir, channel_factory=factory, **tls) as h:
            status = await h.stub.GetStatus(pb.GetStatusRequest(),
                                            metadata=(("authorization", "Bearer s3cret"),))
            plain = grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_stub(plain).GetStatus(pb.GetStatusRequest(), timeout=2)
            await plain.close()
            # The controller's side: the rollout pool over TLS with the shared token.
            pool = RolloutPool([f"localhost:{h.server.port}"], auth_token="s3cret",
                               tls_root_cert=cert.read_bytes())
            await pool.start(ready_timeout_s=10)
            try:
                group = await asyncio.wait_for(pool.submit(rollout_request("tls-1")), 30)
            finally:
                await pool.close()
            return status, err.value.code(), group

    status, plain_code, group = asyncio.run(scenario())
    assert status.engine_kind == "arithmetic"
    assert plain_code == grpc.StatusCode.UNAVAILABLE
    assert group.request_id == "tls-1" and len(group.trajectories) == 2
    assert all(len(t.output_ids) == len(t.versions) > 0 for t in group.trajectories)


def pb_stub(channel):
    from areal_jax.protocol import rollout_pb2_grpc

    return rollout_pb2_grpc.RolloutServiceStub(channel)


def test_server_config_errors_name_the_key(tmp_path, tok_dir):
    with pytest.raises(ConfigError, match="tls_cert_path and tls_key_path"):
        server_config(tmp_path, tok_dir, tls_cert_path="/c.pem")
    with pytest.raises(ConfigError, match="max_concurrent_groups: must be >= 1"):
        server_config(tmp_path, tok_dir, max_concurrent_groups=0)
    with pytest.raises(ConfigError, match=r"max_message_mb: must be <= 2047 \(gRPC's"):
        server_config(tmp_path, tok_dir, max_message_mb=2048)  # an OverflowError at start
    with pytest.raises(ConfigError, match="unknown config key engine.modle_path"):
        server_config(tmp_path, tok_dir, engine={"modle_path": "x"})
    with pytest.raises(ConfigError, match="engine.model_path: required"):
        server_config(tmp_path, tok_dir, engine={"kind": "sglang"})
    with pytest.raises(ConfigError, match=r"rewards.max_call_s: must be >= rewards.timeout_s"):
        server_config(tmp_path, tok_dir, rewards={"timeout_s": 30, "max_call_s": 10})
    with pytest.raises(ConfigError, match=r"rewards.timeouts_to_probe: must be >= 1, got 0"):
        server_config(tmp_path, tok_dir, rewards={"timeouts_to_probe": 0})
    pool, _ = _reward_pool(
        server_config(tmp_path, tok_dir, rewards={"num_workers": 1, "timeouts_to_probe": 3}).rewards)
    with pool:
        assert pool.timeouts_to_probe == 3


def test_a_second_server_on_a_busy_port_fails_instead_of_sharing_it(tmp_path, tok_dir):
    # gRPC's default SO_REUSEPORT let two servers listen on one port, each taking a share of
    # the connections: a duplicate launch served part of the trainer's requests unseen.
    second = ArithmeticEngine()

    async def main():
        async with serving(tmp_path, tok_dir) as h:
            with pytest.raises(ConfigError, match=f"port: cannot listen on 127.0.0.1:{h.server.port}"):
                await start_server(server_config(tmp_path / "b", tok_dir, port=h.server.port),
                                   engine=second, scorer=ExactAnswerScorer(),
                                   reward_names=ExactAnswerScorer().names)

    asyncio.run(main())
    assert not second.started  # found before its engine loaded (and compiled, took memory)


def test_cli_reports_config_errors(capsys):
    assert cli.main(["serve", "engine.kind=sglang", "port=-1"]) == 2
    assert "engine.model_path: required" in capsys.readouterr().err


def test_engine_factory_explains_a_missing_engine_module(monkeypatch, tmp_path):
    monkeypatch.setitem(engines.ENGINE_MODULES, "jax", "rollout.engines.not_written_yet")
    message = "engine.kind: 'jax' needs the module rollout.engines.not_written_yet"
    with pytest.raises(ConfigError, match=message):
        engines.create_engine(EngineConfig(kind="jax", model_path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "max_position_embeddings": 32}')
    with pytest.raises(ConfigError, match="engine.options.tp_size: must be >= 1"):
        engines.create_engine(
            EngineConfig(kind="sglang", model_path=str(tmp_path), options={"tp_size": 0})
        )
    built = engines.create_engine(EngineConfig(kind="sglang", model_path=str(tmp_path)))
    assert (built.kind, built.vocab_size, built.max_context_len) == ("sglang", 10, 31)


def test_sampling_params_name_the_invalid_field():
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=4, temperature=float("inf")), "temperature"),  # sampled uniformly
        (dict(max_new_tokens=4, top_p=0), "top_p"),
        (dict(max_new_tokens=4, top_k=0), "top_k"),
        (dict(max_new_tokens=4, seed=-1), "seed"),
        (dict(max_new_tokens=4, stop_token_ids=(-2,)), "stop_token_ids[0]"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidParamError) as err:
            SamplingParams(**kwargs)
        assert err.value.field == field
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[1, 10])
    with pytest.raises(InvalidParamError, match=r"stop_token_ids\[1\]: 10 is outside .*\[0, 10\)"):
        params.validate(vocab_size=10)
    assert SamplingParams(max_new_tokens=1, temperature=0).greedy


def test_admission_bounds_queue_and_slots():
    async def scenario():
        adm = Admission(max_queued=1, max_running=1)
        await adm.reserve()
        await adm.start()
        await adm.reserve()
        blocked = asyncio.create_task(adm.reserve())
        await asyncio.sleep(0.01)
        assert not blocked.done() and (adm.queued, adm.running) == (1, 1)
        adm.release(started=True)
        await asyncio.wait_for(blocked, 1)
        await adm.start()
        assert (adm.queued, adm.running) == (1, 1)
        waiting = asyncio.create_task(adm.start())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        adm.close()
        with pytest.raises(AdmissionClosed):
            await waiting
        with pytest.raises(AdmissionClosed):
            await adm.reserve()

    asyncio.run(scenario())


def test_admission_bounds_the_bytes_it_holds():
    # Counted by number alone, 1024 queued requests of up to max_message_mb (64 MiB) each
    # could hold 68 GiB of a server's memory.
    async def scenario():
        adm = Admission(max_queued=8, max_running=8, max_bytes=100)
        await adm.reserve(60)
        blocked = asyncio.create_task(adm.reserve(50))
        await asyncio.sleep(0.01)
        assert not blocked.done() and adm.held_bytes == 60
        await adm.reserve(40)  # fits beside the first
        adm.release(started=False, size=60)
        await asyncio.wait_for(blocked, 1)  # 40 + 50 fits: woken
        assert (adm.queued, adm.held_bytes) == (2, 90)
        adm.release(started=False, size=40)
        adm.release(started=False, size=50)
        await asyncio.wait_for(adm.reserve(500), 1)  # larger than the budget: alone, admitted
        assert adm.held_bytes == 500
        late = asyncio.create_task(adm.reserve(1))
        await asyncio.sleep(0.01)
        assert not late.done()
        late.cancel()

    asyncio.run(scenario())


def test_a_server_stops_reading_requests_past_its_byte_budget(tmp_path, tok_dir):
    big = {"answer": "19", "padding": "x" * ((1 << 20) - 4096)}  # requests of just under 1 MiB

    async def scenario():
        engine = ArithmeticEngine(step_s=0.02)
        async with serving(tmp_path, tok_dir, engine=engine, max_admitted_mb=3) as h:
            call = h.stub.Rollout()
            for i in range(6):  # twenty tokens each (no sum to answer): 0.4 s a group
                request = rollout_request(f"big{i}", prompt="no sum", max_new_tokens=20)
                request.metadata.update(big)
                await call.write(request)
            await call.done_writing()
            most = 0
            replies = []
            reading = asyncio.ensure_future(_read_all(call, replies))
            while not reading.done():
                status = await h.stub.GetStatus(pb.GetStatusRequest())
                most = max(most, status.queued_requests + status.running_requests)
                await asyncio.sleep(0.005)
            return most, replies

    most, replies = asyncio.run(scenario())
    assert most == 3
    assert sorted(r.request_id for r in replies) == [f"big{i}" for i in range(6)]
    assert not any(r.HasField("error") for r in replies)


async def _read_all(call, into: list) -> None:
    async for reply in call:
        into.append(reply)


def test_activity_clock_counts_overlapping_work_once():
    clock = ActivityClock()
    with clock.track():
        time.sleep(0.02)
        with clock.track():
            time.sleep(0.02)
    assert 0.04 <= clock.total < 0.2


@pytest.mark.parametrize("configured", [False, True])
def test_push_directories_of_servers_that_are_gone_are_removed(tmp_path, monkeypatch,
                                                               configured):
    # A SIGKILLed server left its push directory (a whole checkpoint) for ever, and its restart
    # made another; in a configured push_dir every pushed checkpoint stayed, killed or not.
    # Whether its server is gone is told by the lock it held, not by its pid: servers of
    # several containers (one host name, separate pid namespaces) may share a push_dir.
    import fcntl
    import tempfile

    from rollout.server import _fresh_push_dir

    root = tmp_path / "push" if configured else tmp_path
    root.mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def made(name: str, lock: bool = True) -> Path:
        (root / name).mkdir()
        if lock:
            (root / name / ".owner.lock").touch()
        return root / name

    held = os.open(made("areal-jax-push-1@elsewhere-running") / ".owner.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # its server runs (in another pid namespace, say)
    made(f"areal-jax-push-{gone.pid}@here-beingmade", lock=False)  # no lock yet: being made
    made("areal-jax-push-1-alive", lock=False)  # an older server's: pid 1 is alive
    made(f"areal-jax-push-{gone.pid}@elsewhere-killed")  # its lock free: gone
    made(f"areal-jax-push-{gone.pid}-k1ll3d", lock=False)  # an older server's, its pid gone
    try:
        fresh, lock = _fresh_push_dir(str(root) if configured else None)
        # Visible only locked (made under a hidden name, renamed once locked): a server
        # starting beside it took it, unlocked, for a gone server's and removed it.
        other = os.open(Path(fresh) / ".owner.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
        os.close(lock)
    finally:
        os.close(held)
    assert not list(root.glob(".areal-jax-push-*"))
    fresh = Path(fresh)
    assert fresh.parent == root and fresh.name.startswith(f"areal-jax-push-{os.getpid()}@")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("areal-jax-push-")) == \
        sorted(["areal-jax-push-1@elsewhere-running", f"areal-jax-push-{gone.pid}@here-beingmade",
                "areal-jax-push-1-alive", fresh.name])


def test_a_configured_push_dir_holds_nothing_of_a_server_that_stopped(tmp_path, tok_dir):
    # Its own directory inside push_dir goes with it; push_dir itself stays a root weights
    # may be loaded from by path (a shared export directory).
    async def scenario():
        async with serving(tmp_path, tok_dir, push_dir=str(tmp_path / "push")) as h:
            inside = list((tmp_path / "push").iterdir())
            shared = write_checkpoint(tmp_path / "push" / "exports" / "v1", "v1")
            update = await h.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(shared),
                                                                        version=1))
        return inside, update.version

    inside, version = asyncio.run(scenario())
    assert len(inside) == 1 and inside[0].name.startswith("areal-jax-push-") and version == 1
    assert [p.name for p in (tmp_path / "push").iterdir()] == ["exports"]


def test_an_engine_that_does_not_start_is_one_line_from_serve(tmp_path, capsys):
    # `serve` with engine.kind=sglang where SGLang cannot be launched ended in a traceback.
    from _hf_models import hf_model, save_hf_model

    model = make_tokenizer_dir(save_hf_model(hf_model("qwen2", seed=1), tmp_path / "m"))
    config = tmp_path / "server.yaml"
    config.write_text("port: 0\nengine: {kind: sglang}\n")
    code = cli.main(["serve", "--config", str(config), f"engine.model_path={model}",
                     "engine.options.python=/bin/false",
                     f"engine.options.log_path={tmp_path / 'sglang.log'}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "areal-jax serve: the sglang engine did not start:" in err and "exited" in err
