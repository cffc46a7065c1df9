"""The wire protocol: committed stubs match the .proto, and the conversion helpers round-trip."""

import re
from pathlib import Path

import numpy as np
import pytest

from areal_jax.protocol import (
    SERVICE_NAME,
    finish_reason_from_proto,
    finish_reason_to_proto,
    group_from_proto,
    group_to_proto,
    push_weight_requests,
    rollout_pb2,
)
from areal_jax.protocol.generate import REPO_ROOT, generate
from areal_jax.trajectory import Trajectory, TrajectoryGroup

# Tool-version stamps may differ between machines without the stubs being stale.
_VERSION_STAMPS = [
    (re.compile(r"# Protobuf Python Version: .*"), "# Protobuf Python Version: X"),
    (
        re.compile(
            r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)[\s\d,]*"
        ),
        r"\1 X,",
    ),
    (re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"), "GRPC_GENERATED_VERSION = 'X'"),
]


def _normalised(text: str) -> str:
    for pattern, replacement in _VERSION_STAMPS:
        text = pattern.sub(replacement, text)
    return text


def test_committed_stubs_match_the_proto(tmp_path):
    generated = generate(tmp_path)
    assert len(generated) == 3
    for path in generated:
        relative = path.relative_to(tmp_path)
        committed = REPO_ROOT / relative
        assert committed.is_file(), f"{relative} is not committed"
        assert _normalised(committed.read_text()) == _normalised(path.read_text()), (
            f"{relative} is stale: run `python -m areal_jax.protocol.generate`"
        )


def test_service_is_in_the_versioned_package():
    assert SERVICE_NAME == "areal_jax.rollout.v1.RolloutService"
    methods = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name
    streaming = {name: (m.client_streaming, m.server_streaming) for name, m in methods.items()}
    assert streaming == {
        "Rollout": (True, True),
        "Generate": (False, True),
        "UpdateWeights": (False, False),
        "PushWeights": (True, False),
        "Pause": (False, False),
        "Resume": (False, False),
        "GetStatus": (False, False),
        "Release": (False, False),
    }


def _group() -> TrajectoryGroup:
    prompt = [5, 6, 7]
    return TrajectoryGroup(
        "req-1",
        [
            Trajectory(prompt, [1, 2, 3], [-0.5, -0.25, -1.0], [3, 3, 4], 1.0, "stop"),
            Trajectory(
                prompt, [9, 8, 7, 6], [-0.1, 0.0, 0.0, -0.2], [4, -1, -1, 4], 0.0, "length",
                output_mask=[1, 0, 0, 1],
            ),
            Trajectory(prompt, [4], [-2.0], [4], 0.0, "abort"),
        ],
    )  # fmt: skip


def test_group_round_trips_through_its_message():
    timing = {"queue_s": 0.5, "generation_s": 2.0, "reward_s": 0.25}
    msg = group_to_proto(_group(), timing)
    decoded = rollout_pb2.TrajectoryGroup.FromString(msg.SerializeToString())
    back = group_from_proto(decoded)
    assert back.group_id == "req-1"
    assert back.metadata == {"timing": timing}
    failed = group_from_proto(group_to_proto(_group(), timing, ["first: " + "x" * 2000, "2nd"],
                                             reward_calls=4))
    assert (failed.metadata["reward_calls"], failed.metadata["reward_failures"]) == (4, 2)
    assert failed.metadata["reward_error"] == ("first: " + "x" * 2000)[:1000]
    for want, got in zip(_group().trajectories, back.trajectories, strict=True):
        np.testing.assert_array_equal(got.prompt_ids, want.prompt_ids)
        np.testing.assert_array_equal(got.output_ids, want.output_ids)
        np.testing.assert_allclose(got.behav_logprobs, want.behav_logprobs)
        np.testing.assert_array_equal(got.versions, want.versions)
        np.testing.assert_array_equal(got.output_mask, want.output_mask)
        assert (got.reward, got.finish_reason) == (want.reward, want.finish_reason)
    # the prompt travels once per group; an all-ones mask is left empty on the wire
    assert list(msg.prompt_ids) == [5, 6, 7]
    assert list(msg.trajectories[0].output_mask) == []
    assert list(msg.trajectories[1].output_mask) == [1, 0, 0, 1]


def test_group_message_rules():
    group = _group()
    group.trajectories[1].prompt_ids = np.array([5, 6], dtype=np.int32)
    with pytest.raises(ValueError, match=r"trajectories\[1\]\.prompt_ids"):
        group_to_proto(group)
    with pytest.raises(ValueError, match="no trajectories"):
        group_to_proto(TrajectoryGroup("empty", []))
    failed = rollout_pb2.TrajectoryGroup(
        request_id="r", error=rollout_pb2.RequestError(code=3, field="top_p", message="bad")
    )
    with pytest.raises(ValueError, match=r"request 'r' failed \(top_p\): bad"):
        group_from_proto(failed)


def test_finish_reasons_map_both_ways():
    for reason in ("stop", "length", "abort"):
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) == reason
    with pytest.raises(ValueError, match="'eos'"):
        finish_reason_to_proto("eos")
    with pytest.raises(ValueError, match="not a finished state"):
        finish_reason_from_proto(rollout_pb2.FINISH_REASON_UNSPECIFIED)


def test_push_requests_carry_a_header_then_every_byte_in_order(tmp_path):
    files = {"config.json": b'{"a": 1}', "model.safetensors": bytes(range(256)) * 10, "e": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    requests = list(push_weight_requests(tmp_path, version=7, chunk_bytes=1000))
    header = requests[0].header
    assert header.version == 7
    assert {f.name: f.size for f in header.files} == {k: len(v) for k, v in files.items()}
    received: dict[str, bytes] = {}
    for req in requests[1:]:
        assert req.WhichOneof("item") == "chunk"
        assert len(req.chunk.data) <= 1000
        assert req.chunk.offset == len(received.get(req.chunk.name, b""))
        received[req.chunk.name] = received.get(req.chunk.name, b"") + req.chunk.data
    assert received == {k: v for k, v in files.items() if v}
    assert len(requests) == 1 + 1 + 3  # header, config.json, 2560 bytes in 3 chunks
    assert not header.force
    forced = next(push_weight_requests(tmp_path, version=2, force=True)).header
    assert (forced.version, forced.force) == (2, True)


def test_push_requests_reject_what_cannot_be_sent(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list(push_weight_requests(tmp_path / "missing", 1))
    with pytest.raises(ValueError, match="is empty"):
        list(push_weight_requests(tmp_path, 1))
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="non-file entry 'sub'"):
        list(push_weight_requests(tmp_path, 1))
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(push_weight_requests(tmp_path, 1, chunk_bytes=0))


def test_generator_writes_where_the_imports_expect(tmp_path):
    generated = {p.relative_to(tmp_path).as_posix() for p in generate(tmp_path)}
    assert generated == {
        "areal_jax/protocol/v1/rollout_pb2.py",
        "areal_jax/protocol/v1/rollout_pb2.pyi",
        "areal_jax/protocol/v1/rollout_pb2_grpc.py",
    }
    grpc_stub = (tmp_path / "areal_jax/protocol/v1/rollout_pb2_grpc.py").read_text()
    assert "from areal_jax.protocol.v1 import rollout_pb2" in grpc_stub
    assert Path(REPO_ROOT / "protos/areal_jax/protocol/v1/rollout.proto").is_file()
