"""Rollout requests for dataset prompts."""

from __future__ import annotations

from areal_jax.data.dataset import PromptItem, metadata_text
from areal_jax.protocol.v1 import rollout_pb2 as pb


def rollout_request(item: PromptItem, request_id: str, reward: str, group_size: int,
                    max_new_tokens: int, temperature: float, top_p: float = 1.0,
                    top_k: int = -1, seed: int | None = None) -> pb.RolloutRequest:
    """A RolloutRequest for one prompt; metadata values that are not strings go as JSON."""
    metadata = {k: metadata_text(v) for k, v in item.metadata.items()}
    params = pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, greedy=temperature == 0)
    if seed is not None:
        params.seed = seed
    return pb.RolloutRequest(request_id=request_id, prompt_ids=item.prompt_ids,
                             prompt_text=item.prompt_text, metadata=metadata, reward_name=reward,
                             group_size=group_size, sampling_params=params)
