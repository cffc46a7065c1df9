"""A rollout server on loopback with the arithmetic engine and the exact-answer scorer."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import grpc
from _rollout_fakes import ArithmeticEngine, ExactAnswerScorer, encode

from areal_jax.config import from_dict
from areal_jax.protocol import rollout_pb2 as pb
from areal_jax.protocol import rollout_pb2_grpc as pb_grpc
from rollout.config import ServerConfig
from rollout.server import RolloutServer, start_server


@dataclasses.dataclass
class Harness:
    server: RolloutServer
    stub: pb_grpc.RolloutServiceStub
    channel: grpc.aio.Channel
    engine: ArithmeticEngine
    scorer: ExactAnswerScorer

    @property
    def push_dir(self) -> Path:
        """The server's own directory for pushed checkpoints, inside ``push_dir``."""
        return self.server.servicer.push_dir

    def pushed(self) -> list[str]:
        """The names of the pushed checkpoints kept in ``push_dir`` (not its lock file)."""
        return sorted(p.name for p in self.push_dir.iterdir() if not p.name.startswith("."))


def server_config(tmp_path: Path, tokenizer_dir: Path, **overrides) -> ServerConfig:
    data = {
        "engine": {"model_path": str(tmp_path / "model"), "tokenizer_path": str(tokenizer_dir)},
        "port": 0,
        "push_dir": str(tmp_path / "push"),
        **overrides,
    }
    return from_dict(ServerConfig, data)


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path,
    tokenizer_dir: Path,
    engine: ArithmeticEngine | None = None,
    channel_factory=None,
    **overrides,
):
    """Start a server, yield a ``Harness``, stop the server."""
    engine = engine or ArithmeticEngine()
    scorer = ExactAnswerScorer()
    config = server_config(tmp_path, tokenizer_dir, **overrides)
    server = await start_server(config, engine=engine, scorer=scorer, reward_names=scorer.names)
    target = f"127.0.0.1:{server.port}"
    channel = channel_factory(target) if channel_factory else grpc.aio.insecure_channel(target)
    try:
        yield Harness(server, pb_grpc.RolloutServiceStub(channel), channel, engine, scorer)
    finally:
        await channel.close()
        await server.stop(grace=1.0)


def rollout_request(
    request_id: str,
    prompt: str = "12+7=",
    answer: str = "19",
    group_size: int = 2,
    reward_name: str = "exact",
    **sampling,
) -> pb.RolloutRequest:
    params = {"max_new_tokens": 8, "temperature": 1.0, "seed": 0, **sampling}
    return pb.RolloutRequest(
        request_id=request_id,
        prompt_ids=encode(prompt),
        metadata={"answer": answer},
        reward_name=reward_name,
        group_size=group_size,
        sampling_params=pb.SamplingParams(**params),
    )


async def rollout(stub: pb_grpc.RolloutServiceStub, requests, metadata=None) -> list:
    """Send ``requests`` on one stream, close it, and return every response."""
    call = stub.Rollout(metadata=metadata)
    for req in requests:
        await call.write(req)
    await call.done_writing()
    return [resp async for resp in call]
