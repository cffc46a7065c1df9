"""Validation of incoming requests: protocol messages to ``RolloutTask`` / ``SamplingParams``.

Every problem raises ``InvalidParamError`` naming the request field (``sampling_params.top_p``,
``prompt_ids[3]``, ...), which the server returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from areal_jax.protocol.v1 import rollout_pb2 as pb
from rollout.engine import MAX_VERSION, InvalidParamError, SamplingParams
from rollout.workflows.base import RolloutTask


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the serving engine and the server accept."""

    vocab_size: int
    max_context_len: int
    reward_names: Collection[str]
    max_group_size: int


def check_version_range(version: int, field: str) -> None:
    """A weight version must fit the int32 every generated token records it in."""
    if not 0 <= version <= MAX_VERSION:
        raise InvalidParamError(field, f"must be in [0, {MAX_VERSION}], got {version}")


def sampling_from_proto(msg: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    """Fill defaults for unset fields and validate; field names carry ``sampling_params.``."""
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    if msg.greedy:
        if msg.HasField("temperature") and temperature != 0:
            raise InvalidParamError(
                "sampling_params.greedy", f"conflicts with temperature {temperature}"
            )
        temperature = 0.0
    try:
        params = SamplingParams(
            max_new_tokens=msg.max_new_tokens,
            temperature=temperature,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k if msg.HasField("top_k") else -1,
            stop_token_ids=tuple(msg.stop_token_ids),
            seed=msg.seed if msg.HasField("seed") else None,
        )
        params.validate(vocab_size)
    except InvalidParamError as e:
        raise e.prefixed("sampling_params") from None
    return params


def check_prompt(
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    max_context_len: int,
    budget_field: str = "max_new_tokens",
) -> None:
    """Non-empty, inside the vocabulary, and room for ``max_new_tokens`` in the context.

    Errors name ``prompt_ids`` / ``prompt_ids[i]`` or ``budget_field``.
    """
    if not prompt_ids:
        raise InvalidParamError("prompt_ids", "must not be empty")
    if len(prompt_ids) >= max_context_len:  # checked before any id is read
        raise InvalidParamError(
            "prompt_ids", f"{len(prompt_ids)} tokens leave no room for an answer in the "
            f"context length {max_context_len}")
    if len(prompt_ids) + max_new_tokens > max_context_len:
        raise InvalidParamError(
            budget_field,
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the context length {max_context_len}",
        )
    for i, tok in enumerate(prompt_ids):
        if not 0 <= tok < vocab_size:
            raise InvalidParamError(
                f"prompt_ids[{i}]", f"{tok} is outside the vocabulary [0, {vocab_size})"
            )


def _check_prompt(prompt_ids: Sequence[int], params: SamplingParams, limits: Limits) -> None:
    check_prompt(prompt_ids, params.max_new_tokens, limits.vocab_size, limits.max_context_len,
                 budget_field="sampling_params.max_new_tokens")


MAX_REQUEST_ID_CHARS = 256


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidParamError("request_id", "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidParamError("request_id", f"{len(request_id)} characters, at most "
                                f"{MAX_REQUEST_ID_CHARS}")


def rollout_task_from_proto(req: pb.RolloutRequest, limits: Limits) -> RolloutTask:
    """Validated ``RolloutTask`` of a ``RolloutRequest``."""
    _check_request_id(req.request_id)
    if not req.HasField("sampling_params"):
        raise InvalidParamError("sampling_params", "required")
    params = sampling_from_proto(req.sampling_params, limits.vocab_size)
    _check_prompt(req.prompt_ids, params, limits)
    if not 1 <= req.group_size <= limits.max_group_size:
        raise InvalidParamError(
            "group_size", f"must be in [1, {limits.max_group_size}], got {req.group_size}"
        )
    if req.reward_name not in limits.reward_names:
        raise InvalidParamError(
            "reward_name",
            f"reward {req.reward_name!r} is not one of this server's (its built-ins and "
            f"rewards.custom; a request names no code to import: add it to the server's "
            f"rewards.custom); available: {', '.join(sorted(limits.reward_names))}",
        )
    return RolloutTask(
        request_id=req.request_id,
        prompt_ids=tuple(req.prompt_ids),
        sampling=params,
        group_size=req.group_size,
        reward_name=req.reward_name,
        metadata=dict(req.metadata),
        prompt_text=req.prompt_text,
    )


def generate_args_from_proto(
    req: pb.GenerateRequest, limits: Limits
) -> tuple[str, list[int], SamplingParams]:
    """``(request_id, prompt_ids, params)`` of a validated ``GenerateRequest``."""
    _check_request_id(req.request_id)
    if not req.HasField("sampling_params"):
        raise InvalidParamError("sampling_params", "required")
    params = sampling_from_proto(req.sampling_params, limits.vocab_size)
    _check_prompt(req.prompt_ids, params, limits)
    return req.request_id, list(req.prompt_ids), params
