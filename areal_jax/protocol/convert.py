"""Trajectory groups to and from ``TrajectoryGroup`` messages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.trajectory import Trajectory, TrajectoryGroup

_FINISH_TO_PROTO = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
TIMING_KEYS = ("queue_s", "generation_s", "reward_s")


def finish_reason_to_proto(reason: str) -> int:
    """``"stop" | "length" | "abort"`` to the ``FinishReason`` enum value."""
    try:
        return _FINISH_TO_PROTO[reason]
    except KeyError:
        raise ValueError(
            f"finish_reason {reason!r} is not one of {sorted(_FINISH_TO_PROTO)}"
        ) from None


def finish_reason_from_proto(value: int) -> str:
    """``FinishReason`` enum value to ``"stop" | "length" | "abort"``."""
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"finish_reason {value} is not a finished state") from None


MAX_REWARD_ERROR_CHARS = 1000


def group_to_proto(
    group: TrajectoryGroup, timing: dict[str, float] | None = None,
    reward_failures: Sequence[str] = (), reward_calls: int = 0,
) -> pb.TrajectoryGroup:
    """Message for a finished group; every trajectory must share the group's prompt.
    ``reward_failures``: what went wrong in each reward call that failed (it scored 0), of the
    ``reward_calls`` the group's workflow made."""
    if not group.trajectories:
        raise ValueError(f"group {group.group_id!r} has no trajectories")
    prompt = group.trajectories[0].prompt_ids
    msg = pb.TrajectoryGroup(request_id=group.group_id, prompt_ids=prompt.tolist())
    for i, traj in enumerate(group.trajectories):
        if not np.array_equal(traj.prompt_ids, prompt):
            raise ValueError(
                f"group {group.group_id!r}: trajectories[{i}].prompt_ids differ from "
                "trajectories[0].prompt_ids (a group shares one prompt)"
            )
        mask = traj.output_mask
        msg.trajectories.append(
            pb.Trajectory(
                output_ids=traj.output_ids.tolist(),
                behav_logprobs=traj.behav_logprobs.tolist(),
                versions=traj.versions.tolist(),
                output_mask=[] if mask.all() else mask.tolist(),
                reward=float(traj.reward),
                finish_reason=finish_reason_to_proto(traj.finish_reason),
            )
        )
    if timing:
        msg.timing.CopyFrom(pb.Timing(**{k: float(timing.get(k, 0.0)) for k in TIMING_KEYS}))
    msg.reward_calls = max(reward_calls, len(reward_failures))
    if reward_failures:
        msg.reward_failures = len(reward_failures)
        msg.reward_error = reward_failures[0][:MAX_REWARD_ERROR_CHARS]
    return msg


def group_from_proto(msg: pb.TrajectoryGroup) -> TrajectoryGroup:
    """Trajectory group of a successful response; its timing lands in ``metadata["timing"]``,
    its reward calls in ``metadata["reward_calls"]``, the failed ones, if any, in
    ``metadata["reward_failures"]`` (and the first's message in ``metadata["reward_error"]``).

    Raises ValueError for a response that carries an error (check ``msg.HasField("error")``).
    """
    if msg.HasField("error"):
        err = msg.error
        where = f" ({err.field})" if err.field else ""
        raise ValueError(f"request {msg.request_id!r} failed{where}: {err.message}")
    trajectories = [
        Trajectory(
            prompt_ids=np.asarray(msg.prompt_ids, dtype=np.int32),
            output_ids=np.asarray(t.output_ids, dtype=np.int32),
            behav_logprobs=np.asarray(t.behav_logprobs, dtype=np.float32),
            versions=np.asarray(t.versions, dtype=np.int32),
            reward=t.reward,
            finish_reason=finish_reason_from_proto(t.finish_reason),
            output_mask=np.asarray(t.output_mask, dtype=np.int32) if len(t.output_mask) else None,
        )
        for t in msg.trajectories
    ]
    timing = {k: getattr(msg.timing, k) for k in TIMING_KEYS}
    metadata = {"timing": timing}
    if msg.reward_calls:
        metadata["reward_calls"] = msg.reward_calls
    if msg.reward_failures:
        metadata.update(reward_failures=msg.reward_failures, reward_error=msg.reward_error)
    return TrajectoryGroup(msg.request_id, trajectories, metadata)
