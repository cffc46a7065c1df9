"""Minimal safetensors reader/writer over NumPy (bf16 via ml_dtypes), lazy and validating.

Reading memory-maps the file and checks the header as the format defines it before any tensor
is read: a header of at most ``MAX_HEADER_BYTES`` holding a JSON object, each entry a dtype,
a shape of non-negative integers and integer byte offsets, the tensors' byte ranges laid end to
end from 0 with no gap or overlap and ending at the end of the file. A truncated or forged file
fails with a message naming the file and tensor, never reads bytes outside its own range.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # as the reference implementation: no real header comes close
MAX_DIMENSIONS = 64  # NumPy's own limit on an array's dimensions


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed; the message names it."""


def _open_regular(path: Path):
    """``path`` opened for reading, if it is a regular file (a FIFO's open or read would wait
    for a writer for ever: it is opened without waiting, and refused); else SafetensorsError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SafetensorsError(f"weights file {path} does not exist") from None
    except OSError as e:
        raise SafetensorsError(f"weights file {path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SafetensorsError(f"weights file {path} is not a regular file")
    return os.fdopen(fd, "rb")


def header_bytes(path: str | Path) -> int:
    """The length of the header of the safetensors file ``path`` (its first 8 bytes), 0 where
    the file cannot tell (missing, not a file, shorter than that: ``SafetensorsFile`` names
    why)."""
    try:
        with _open_regular(Path(path)) as f:
            raw = f.read(8)
    except (OSError, SafetensorsError):
        return 0
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: ``keys()``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with _open_regular(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{self.path} is truncated (no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{self.path} has a header of {header_len} bytes, more "
                                       f"than {MAX_HEADER_BYTES}")
            if header_len > size - 8:
                raise SafetensorsError(f"{self.path} is truncated (header of {header_len} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
                raise SafetensorsError(f"{self.path} has a corrupt header: {e!s:.200}") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise SafetensorsError(f"{self.path}: __metadata__ is not a JSON object")
        self.metadata = metadata
        self._data_start = 8 + header_len
        self._entries = {name: self._checked(name, entry) for name, entry in header.items()}
        end = 0
        for name, entry in sorted(self._entries.items(), key=lambda kv: kv[1]["data_offsets"]):
            begin, stop = entry["data_offsets"]
            if begin != end:
                raise SafetensorsError(
                    f"{self.path}: tensor {name} starts at byte {begin} of the data, the tensor "
                    f"before it ends at {end} (byte ranges must follow each other)")
            if self._data_start + stop > size:
                raise SafetensorsError(
                    f"{self.path} is truncated: tensor {name} needs bytes up to "
                    f"{self._data_start + stop}, file has {size}")
            end = stop
        if self._data_start + end < size:
            raise SafetensorsError(f"{self.path} has {size - self._data_start - end} bytes "
                                   "after its last tensor")
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def _checked(self, name: str, entry) -> dict:
        """``entry`` of tensor ``name`` if well formed (dtype, shape, offsets); else raise."""
        def bad(why: str) -> SafetensorsError:
            return SafetensorsError(f"{self.path}: tensor {name} {why}")

        if not isinstance(entry, dict):
            raise bad("has a header entry that is not a JSON object")
        if entry.get("dtype") not in DTYPES:
            raise bad(f"has unsupported dtype {entry.get('dtype')!r:.40}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise bad(f"has a shape that is not a list of integers in [0, 2**63): {shape!r:.80}")
        if len(shape) > MAX_DIMENSIONS:
            raise bad(f"has {len(shape)} dimensions, more than {MAX_DIMENSIONS}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets)):
            raise bad(f"has data_offsets that are not two integers in [0, 2**63): {offsets!r:.80}")
        begin, end = offsets
        expected = math.prod(shape) * DTYPES[entry["dtype"]].itemsize  # exact: no int64 wrap
        if end - begin != expected:
            raise bad(f"has a byte range of {end - begin} bytes, its dtype and shape need "
                      f"{expected}")
        return entry

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only NumPy array backed by the memory map."""
        if name not in self._entries:
            raise SafetensorsError(f"{self.path} has no tensor {name}")
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        buf = self._mmap[self._data_start + begin : self._data_start + end]
        return buf.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _count(x) -> bool:
    """Whether ``x`` is a JSON integer in [0, 2**63) (not a float or a boolean): a size or
    offset any file could have, and small enough that arithmetic on a header's numbers stays
    cheap (a forged header of huge integers would otherwise cost time quadratic in its size)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata=None,
                     durable: bool = True) -> None:
    """Write ``tensors`` (any dtype in DTYPES) to ``path`` with ``{"format": "pt"}`` metadata;
    ``durable``: on disk (fsync) before returning, not only in the page cache."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name} has unsupported dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)  # the array's own bytes, no copy
        f.flush()
        if durable:
            os.fsync(f.fileno())
