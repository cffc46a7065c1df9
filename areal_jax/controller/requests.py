"""Conversions between prompts / trajectories and the wire protocol's messages."""

from __future__ import annotations

import json

import numpy as np

from areal_jax.data.dataset import PromptItem
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.trajectory import Trajectory, TrajectoryGroup

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}


def rollout_request(item: PromptItem, request_id: str, reward: str, group_size: int,
                    max_new_tokens: int, temperature: float, top_p: float = 1.0,
                    top_k: int = -1, seed: int | None = None) -> pb.RolloutRequest:
    """A RolloutRequest for one prompt; metadata values that are not strings go as JSON."""
    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in item.metadata.items()}
    params = pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, greedy=temperature == 0)
    if seed is not None:
        params.seed = seed
    return pb.RolloutRequest(request_id=request_id, prompt_ids=item.prompt_ids,
                             prompt_text=item.prompt_text, metadata=metadata, reward_name=reward,
                             group_size=group_size, sampling_params=params)


def trajectory_group(msg: pb.TrajectoryGroup) -> TrajectoryGroup:
    """The trainer's view of a finished group."""
    prompt = np.asarray(msg.prompt_ids, dtype=np.int32)
    trajectories = [
        Trajectory(
            prompt_ids=prompt,
            output_ids=list(t.output_ids),
            behav_logprobs=list(t.behav_logprobs),
            versions=list(t.versions),
            reward=float(t.reward),
            finish_reason=FINISH_NAMES.get(t.finish_reason, "abort"),
            output_mask=list(t.output_mask) if len(t.output_mask) else None,
        )
        for t in msg.trajectories
    ]
    timing = {"queue_s": msg.timing.queue_s, "generation_s": msg.timing.generation_s,
              "reward_s": msg.timing.reward_s}
    return TrajectoryGroup(group_id=msg.request_id, trajectories=trajectories,
                           metadata={"timing": timing})
