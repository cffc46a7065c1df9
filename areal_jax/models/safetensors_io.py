"""Minimal safetensors reader/writer over NumPy (bf16 via ml_dtypes), lazy and validating.

Reading memory-maps the file and checks every tensor's byte range against the file size, so a
truncated file fails with a message naming the file and tensor instead of a crash later.
"""

from __future__ import annotations

import json
import os
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


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed; the message names it."""


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: ``keys()``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise SafetensorsError(f"weights file {self.path} does not exist")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{self.path} is truncated (no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise SafetensorsError(f"{self.path} is truncated (header of {header_len} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path} has a corrupt header: {e}") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries = header
        self._data_start = 8 + header_len
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {entry.get('dtype')}")
            begin, end = entry["data_offsets"]
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * DTYPES[entry["dtype"]].itemsize
            if end - begin != expected:
                raise SafetensorsError(f"{self.path}: tensor {name} has inconsistent byte range")
            if self._data_start + end > size:
                raise SafetensorsError(
                    f"{self.path} is truncated: tensor {name} needs bytes up to "
                    f"{self._data_start + end}, file has {size}"
                )
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def keys(self) -> list[str]:
        return list(self._entries)

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
