"""The ``PushWeights`` request stream for a checkpoint directory (trainer side)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from areal_jax.protocol.v1 import rollout_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20


def push_weight_requests(
    directory: str | Path,
    version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    force: bool = False,
) -> Iterator[pb.PushWeightsRequest]:
    """Header (version, file names and sizes), then each file's bytes in ``chunk_bytes`` pieces.

    The directory must be flat (a Hugging Face checkpoint is); files are sent in name order.
    ``force`` loads it even when ``version`` is not newer than the server's (see the proto).
    """
    directory = Path(directory)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if not directory.is_dir():
        raise ValueError(f"weights directory {directory} does not exist")
    entries = sorted(directory.iterdir())
    nested = [p.name for p in entries if not p.is_file()]
    if nested:
        raise ValueError(f"weights directory {directory} holds a non-file entry {nested[0]!r}")
    if not entries:
        raise ValueError(f"weights directory {directory} is empty")
    files = [pb.WeightFile(name=p.name, size=p.stat().st_size) for p in entries]
    header = pb.WeightsHeader(version=version, files=files, force=force)
    yield pb.PushWeightsRequest(header=header)
    for path in entries:
        with path.open("rb") as f:
            offset = 0
            while data := f.read(chunk_bytes):
                yield pb.PushWeightsRequest(
                    chunk=pb.FileChunk(name=path.name, offset=offset, data=data)
                )
                offset += len(data)
