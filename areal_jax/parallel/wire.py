"""Messages between trainer processes: a JSON header and flat numeric arrays, no pickle.

Layout: 8-byte little-endian header length, the UTF-8 JSON header (which lists each array's
dtype and shape), then the arrays' bytes in order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from areal_jax.trajectory import Trajectory, TrajectoryGroup

_DTYPES = {"int32": np.int32, "float32": np.float32}
_TRAJ_ARRAYS = ("output_ids", "behav_logprobs", "versions", "output_mask")


def pack_message(header: dict, arrays: Sequence[np.ndarray] = ()) -> bytes:
    """``header`` (JSON-able) and ``arrays`` (int32 / float32) as one byte string."""
    specs = []
    for a in arrays:
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"cannot send a {a.dtype} array: only {sorted(_DTYPES)}")
        specs.append([a.dtype.name, list(a.shape)])
    head = json.dumps({"header": header, "arrays": specs}).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return len(head).to_bytes(8, "little") + head + body


def unpack_message(data: bytes) -> tuple[dict, list[np.ndarray]]:
    """Inverse of ``pack_message``."""
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    arrays, offset = [], 8 + n
    for dtype, shape in head["arrays"]:
        a = np.frombuffer(data, _DTYPES[dtype], count=int(np.prod(shape)), offset=offset)
        arrays.append(a.reshape(shape))
        offset += a.nbytes
    if offset != len(data):
        raise ValueError(f"message has {len(data) - offset} bytes beyond its arrays")
    return head["header"], arrays


def groups_to_message(groups: Sequence[TrajectoryGroup]) -> tuple[dict, list[np.ndarray]]:
    """Trajectory groups as a header and six concatenated arrays (group metadata is not sent:
    the training step does not read it)."""
    trajs = [t for g in groups for t in g.trajectories]
    header = {
        "groups": [[g.group_id, len(g.trajectories)] for g in groups],
        "rewards": [float(t.reward) for t in trajs],
        "finish": [t.finish_reason for t in trajs],
        "prompt_lens": [len(t.prompt_ids) for t in trajs],
        "output_lens": [len(t.output_ids) for t in trajs],
    }
    arrays = [_concat([t.prompt_ids for t in trajs], np.int32)]
    arrays += [_concat([getattr(t, name) for t in trajs], _dtype(name)) for name in _TRAJ_ARRAYS]
    return header, arrays


def groups_from_message(header: dict, arrays: list[np.ndarray]) -> list[TrajectoryGroup]:
    """Inverse of ``groups_to_message``."""
    prompts = np.split(arrays[0], np.cumsum(header["prompt_lens"])[:-1])
    outputs = [np.split(a, np.cumsum(header["output_lens"])[:-1]) for a in arrays[1:]]
    trajs = [
        Trajectory(p, *fields[:3], reward=r, finish_reason=f, output_mask=fields[3])
        for p, *fields, r, f in zip(prompts, *outputs, header["rewards"], header["finish"])
    ]
    groups, start = [], 0
    for group_id, n in header["groups"]:
        groups.append(TrajectoryGroup(group_id, trajs[start : start + n]))
        start += n
    return groups


def examples_to_message(examples) -> tuple[dict, list[np.ndarray]]:
    """SFT (prompt_ids, response_ids) pairs as a header and two concatenated arrays."""
    header = {"lens": [[len(p), len(r)] for p, r in examples]}
    return header, [_concat([p for p, _ in examples], np.int32),
                    _concat([r for _, r in examples], np.int32)]  # fmt: skip


def examples_from_message(header: dict, arrays: list[np.ndarray]) -> list[tuple[list, list]]:
    """Inverse of ``examples_to_message``."""
    lens = np.array(header["lens"], np.int64).reshape(-1, 2)
    prompts = np.split(arrays[0], np.cumsum(lens[:, 0])[:-1])
    responses = np.split(arrays[1], np.cumsum(lens[:, 1])[:-1])
    return [(p.tolist(), r.tolist()) for p, r in zip(prompts, responses)]


def _dtype(name: str):
    return np.float32 if name == "behav_logprobs" else np.int32


def _concat(parts, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype) for p in parts]) if parts else np.zeros(0, dtype)
