"""What a trainer checks in a ``TrajectoryGroup`` before it trusts it: that it answers its
request and holds what training can use. A server with a defect, another version of the
protocol or a broken engine must not stop a run with a traceback or, worse, train it on token
ids outside the vocabulary (gathers clamp them silently), non-finite log-probs or versions
that were never published."""

from __future__ import annotations

import math

import numpy as np

from areal_jax.protocol import GREEDY_TEMPERATURE
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.rewards.registry import MAX_ABS_REWARD

# A log-probability is <= 0; float error may put it above: ~max|logit| / temperature x 6e-8
# in float32, so the slack grows as the temperature falls.
LOGPROB_SLACK = 1e-3
_FINISH_REASONS = frozenset({pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH,
                             pb.FINISH_REASON_ABORT})


def group_problem(request: pb.RolloutRequest, group: pb.TrajectoryGroup, *,
                  vocab_size: int, newest_version: int) -> str | None:
    """What is wrong with ``group``, the answer to ``request`` (no ``error`` set), or None.
    ``vocab_size``: token ids must be below it (0: not checked); ``newest_version``: no
    generated token may carry a later version."""
    if request.prompt_ids and list(group.prompt_ids) != list(request.prompt_ids):
        return "prompt_ids: not the request's prompt"
    if len(group.trajectories) != request.group_size:
        return (f"trajectories: {len(group.trajectories)} for the request's group_size "
                f"{request.group_size}")
    params = request.sampling_params
    greedy = params.greedy or (params.HasField("temperature")
                               and params.temperature < GREEDY_TEMPERATURE)
    temperature = 1.0 if greedy or not params.HasField("temperature") else params.temperature
    slack = max(LOGPROB_SLACK, 1e-5 / temperature)
    for i, t in enumerate(group.trajectories):
        problem = _trajectory_problem(t, vocab_size, newest_version, slack)
        if problem is not None:
            return f"trajectories[{i}].{problem}"
    return None


def _trajectory_problem(t: pb.Trajectory, vocab_size: int, newest_version: int,
                        slack: float) -> str | None:
    n = len(t.output_ids)
    for name in ("behav_logprobs", "versions"):
        if len(getattr(t, name)) != n:
            return f"{name}: {len(getattr(t, name))} entries for {n} output_ids"
    if t.output_mask and len(t.output_mask) != n:
        return f"output_mask: {len(t.output_mask)} entries for {n} output_ids"
    if t.finish_reason not in _FINISH_REASONS:
        return f"finish_reason: {t.finish_reason} is not a finished state"
    if not (math.isfinite(t.reward) and abs(t.reward) <= MAX_ABS_REWARD):
        return f"reward: {t.reward:.6g} is not a finite value within ±{MAX_ABS_REWARD:g}"
    if n == 0:
        return None
    ids = np.asarray(t.output_ids, dtype=np.int64)
    if ids.min() < 0 or (vocab_size and ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        of = f" of a vocabulary of {vocab_size}" if vocab_size else ""
        return f"output_ids: {bad} is not a token id{of}"
    mask = np.asarray(t.output_mask, dtype=np.int64) if t.output_mask else np.ones(n, np.int64)
    if not np.isin(mask, (0, 1)).all():
        return "output_mask: values other than 0 and 1"
    generated = mask == 1
    logprobs = np.asarray(t.behav_logprobs, dtype=np.float64)[generated]
    if not (np.isfinite(logprobs).all() and (logprobs <= slack).all()):
        bad = logprobs[~(np.isfinite(logprobs) & (logprobs <= slack))][0]
        return f"behav_logprobs: {bad:.3g} is not a log-probability"
    versions = np.asarray(t.versions, dtype=np.int64)[generated]
    if versions.size and (versions.min() < 0 or versions.max() > newest_version):
        return (f"versions: {int(versions.min())} to {int(versions.max())}, outside the "
                f"published 0 to {newest_version}")
    return None
