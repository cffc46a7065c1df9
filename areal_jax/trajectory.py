"""Trajectories: what a rollout server returns and what the trainer consumes."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Trajectory:
    """One sampled response to one prompt.

    ``output_mask[t]`` is 1 for tokens the policy generated (trained on) and 0 for tokens a
    workflow inserted (tool output, a second user turn); ``behav_logprobs[t]`` and
    ``versions[t]`` are only meaningful where the mask is 1.
    """

    prompt_ids: np.ndarray  # int32 [P]
    output_ids: np.ndarray  # int32 [O]
    behav_logprobs: np.ndarray  # float32 [O], log_softmax(logits / temperature) of each token
    versions: np.ndarray  # int32 [O], weight version that produced each token
    reward: float = 0.0
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    output_mask: np.ndarray | None = None  # int32 [O]; None means all ones

    def __post_init__(self):
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.output_ids = np.asarray(self.output_ids, dtype=np.int32)
        self.behav_logprobs = np.asarray(self.behav_logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int32)
        if self.output_mask is None:
            self.output_mask = np.ones(len(self.output_ids), dtype=np.int32)
        self.output_mask = np.asarray(self.output_mask, dtype=np.int32)
        if not np.isin(self.output_mask, (0, 1)).all():
            raise ValueError("Trajectory.output_mask must hold only 0 (inserted) and 1 "
                             f"(generated), got values {sorted(set(self.output_mask.tolist()))}")
        n = len(self.output_ids)
        for name in ("behav_logprobs", "versions", "output_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                    f"output_ids has {n}"
                )
        if len(self.prompt_ids) == 0:
            raise ValueError("Trajectory.prompt_ids is empty")

    @property
    def length(self) -> int:
        """Total tokens (prompt + output)."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclasses.dataclass
class TrajectoryGroup:
    """All samples for one prompt; advantages are normalised within a group."""

    group_id: str
    trajectories: list[Trajectory]
    metadata: dict = dataclasses.field(default_factory=dict)
