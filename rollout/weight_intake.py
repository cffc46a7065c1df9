"""Receives a pushed checkpoint (``PushWeights``) into a fresh local directory.

The stream is one ``header`` (version, file names and sizes) followed by each file's bytes in
order. Names must be plain file names; every byte count is checked against the header, and a
directory that failed (bad stream, full disk, rejected load, a stream silent for longer than the
idle timeout or slower than the minimum rate) is removed. Streams are received side by side;
the bytes their headers announce are reserved against the free disk space until each ends.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from areal_jax.models.hf_export import TOKENIZER_FILES
from areal_jax.protocol.v1 import rollout_pb2 as pb
from rollout.engine import InvalidParamError
from rollout.validation import check_version_range


MAX_FILES = 4096  # a checkpoint's files (the largest models have a few hundred shards)
MAX_NAME_BYTES = 255  # NAME_MAX of common filesystems


def _check_name(name: str, field: str) -> None:
    """A plain file name of what a checkpoint holds: weights in safetensors, JSON, and the
    tokenizer's files (never pickled weights, which an engine might read)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InvalidParamError(field, f"{name!r} is not a plain file name")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidParamError(field, f"{name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if not name.endswith((".safetensors", ".json")) and name not in TOKENIZER_FILES:
        raise InvalidParamError(field, f"{name!r} is not a checkpoint file (*.safetensors, "
                                "*.json or a tokenizer's file)")


class PushStalledError(Exception):
    """A push stream sent nothing for the idle timeout, or missed its deadline."""


class PushStream:
    """A client's push stream, read with timeouts that never cancel a read in progress:
    cancelled, gRPC's request iterator closes, and what the client still sends could no longer
    be read before the status goes back (a status sent mid-stream can reach the client as a
    transport error instead)."""

    def __init__(self, messages: AsyncIterator[pb.PushWeightsRequest]):
        self._messages = aiter(messages)
        self._pending: asyncio.Future | None = None

    async def next(self, timeout: float) -> pb.PushWeightsRequest | None:
        """The next message, or None at the stream's end; ``TimeoutError`` after ``timeout``
        seconds (the read goes on, for the next call)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._messages, None))
        done, _ = await asyncio.wait({self._pending}, timeout=max(timeout, 0.0))
        if not done:
            raise TimeoutError
        read, self._pending = self._pending, None
        return read.result()

    async def drain(self, timeout: float) -> None:
        """Read and drop what remains, for at most ``timeout`` seconds."""
        end = asyncio.get_running_loop().time() + timeout
        try:
            while await self.next(end - asyncio.get_running_loop().time()) is not None:
                pass
        except Exception:  # noqa: BLE001 - timed out, or the client went away
            pass
        if self._pending is not None:
            self._pending.cancel()


class WeightIntake:
    """Writes pushed checkpoints under ``root``; keeps only the last one that was loaded.

    A stream that sends nothing for ``idle_timeout_s`` ends with ``PushStalledError``, and so
    does one whose files are not all in after ``idle_timeout_s + size / min_bytes_per_s``
    (an empty chunk, which would keep a stalled stream alive, is refused): a client that
    trickles cannot hold disk space, or the update it announces, for longer than that.
    """

    def __init__(self, root: Path, idle_timeout_s: float = 60.0,
                 min_bytes_per_s: float = 2**20):
        self.root = Path(root)
        self.current: Path | None = None
        self.idle_timeout_s = idle_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self.reserved = 0  # bytes the streams being received announced and have not sent yet

    async def _next(self, stream: PushStream, deadline: float | None = None):
        """The stream's next message, or None at its end; ``PushStalledError`` past the idle
        timeout or the stream's ``deadline`` (event-loop time)."""
        timeout = self.idle_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - asyncio.get_running_loop().time())
        try:
            return await stream.next(timeout)
        except TimeoutError:
            if timeout < self.idle_timeout_s:
                raise PushStalledError(
                    f"the push was not complete within {self.idle_timeout_s:g} s plus its size "
                    f"at {self.min_bytes_per_s / 2**20:g} MiB/s (push_idle_timeout_s, "
                    "push_min_mib_per_s)") from None
            raise PushStalledError(f"the push sent nothing for {self.idle_timeout_s:g} s "
                                   "(push_idle_timeout_s)") from None

    async def receive(
        self,
        requests: PushStream,
        check_header: Callable[[pb.WeightsHeader], None],
    ) -> tuple[Path, pb.WeightsHeader]:
        """Write the stream's files; return ``(directory, header)``.

        ``check_header`` runs on the header (version, force) before any byte is written.
        """
        header = await self._next(requests)
        if header is None or header.WhichOneof("item") != "header":
            raise InvalidParamError("header", "the first message must be the header")
        self._check_header(header.header)
        version = header.header.version
        files = {f.name: f.size for f in header.header.files}
        check_header(header.header)
        needed = sum(files.values())
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if needed > free - self.reserved:
            raise OSError(errno.ENOSPC, f"push needs {needed} bytes, {self.root} has {free} "
                          f"free, {self.reserved} of them announced by pushes in progress")
        deadline = (asyncio.get_running_loop().time() + self.idle_timeout_s
                    + needed / self.min_bytes_per_s)
        directory = self.root / f"v{version}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        self.reserved += needed
        written = dict.fromkeys(files, 0)
        try:
            await self._write_files(requests, directory, files, written, deadline)
            for i, (name, size) in enumerate(files.items()):
                if written[name] != size:
                    raise InvalidParamError(
                        f"header.files[{i}].size",
                        f"{name}: header says {size} bytes, received {written[name]}",
                    )
        except BaseException:
            self.discard(directory)
            raise
        finally:
            self.reserved -= needed - sum(written.values())
        return directory, header.header

    def keep(self, directory: Path) -> None:
        """Make ``directory`` the current checkpoint and remove the previous one."""
        if self.current is not None and self.current != directory:
            self.discard(self.current)
        self.current = directory

    def discard(self, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    @staticmethod
    def _check_header(header: pb.WeightsHeader) -> None:
        check_version_range(header.version, "header.version")
        if not header.files:
            raise InvalidParamError("header.files", "must list at least one file")
        if len(header.files) > MAX_FILES:
            raise InvalidParamError("header.files", f"lists {len(header.files)} files, more "
                                    f"than {MAX_FILES}")
        seen = set()
        for i, f in enumerate(header.files):
            _check_name(f.name, f"header.files[{i}].name")
            if f.name in seen:
                raise InvalidParamError(f"header.files[{i}].name", f"{f.name!r} listed twice")
            seen.add(f.name)
            if f.size < 0:
                raise InvalidParamError(f"header.files[{i}].size", f"must be >= 0, got {f.size}")

    async def _write_files(
        self, requests: PushStream, directory: Path,
        sizes: dict[str, int], written: dict[str, int], deadline: float
    ) -> None:
        """Write the chunks into ``directory``, counting each file's bytes in ``written`` (and
        taking them off the reservation as they land)."""
        handles: dict[str, BinaryIO] = {}
        try:
            while (req := await self._next(requests, deadline)) is not None:
                if req.WhichOneof("item") != "chunk":
                    raise InvalidParamError("header", "sent more than once")
                chunk = req.chunk
                if not chunk.data:  # no progress: empty chunks would keep a stalled stream alive
                    raise InvalidParamError("chunk.data", "empty")
                if chunk.name not in sizes:
                    raise InvalidParamError("chunk.name", f"{chunk.name!r} is not in the header")
                if chunk.offset != written[chunk.name]:
                    raise InvalidParamError(
                        "chunk.offset",
                        f"{chunk.name}: expected offset {written[chunk.name]}, got {chunk.offset}",
                    )
                if written[chunk.name] + len(chunk.data) > sizes[chunk.name]:
                    raise InvalidParamError(
                        "chunk.data", f"{chunk.name}: more bytes than the header's size"
                    )
                if chunk.name not in handles:
                    handles[chunk.name] = open(directory / chunk.name, "wb")  # noqa: SIM115
                await asyncio.to_thread(handles[chunk.name].write, chunk.data)
                written[chunk.name] += len(chunk.data)
                self.reserved -= len(chunk.data)
            for name in sizes:
                if name not in handles:
                    (directory / name).touch()
        finally:
            for handle in handles.values():
                handle.close()
