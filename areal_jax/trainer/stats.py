"""Step metrics: what the batch holds (rewards, lengths, staleness, advantages) and what the
loss saw (clip fraction, KL, entropy, behaviour weights), under the logged key names."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from areal_jax.rl import accumulate_stats, summarize_stats
from areal_jax.trajectory import Trajectory

# policy_loss stat -> metric key (per-token means; *_max as maxima).
_LOSS_KEYS = {
    "clip_frac": "ppo/clip_frac",
    "dual_clip_frac": "ppo/dual_clip_frac",
    "approx_kl": "ppo/approx_kl",
    "entropy": "ppo/entropy",
    "ratio": "ppo/ratio_mean",
    "behav_weight": "ppo/behav_weight_mean",
    "behav_weight_max": "ppo/behav_weight_max",
    "capped_frac": "ppo/behav_capped_frac",
    "n_tokens": "ppo/loss_tokens",
}


def batch_metrics(
    trajs: Sequence[Trajectory], advantages: Sequence[np.ndarray], version: int
) -> dict[str, float]:
    """Reward, response length, per-token staleness and advantage statistics of a batch.

    Staleness of a trained token = ``version`` (the trainer's, before the update) minus the
    version that generated it; it and the advantages are taken over output_mask tokens only.
    ``tokens`` counts every real token (prompt + response) the step processes.
    """
    masks = [t.output_mask.astype(bool) for t in trajs]
    stale = version - np.concatenate([t.versions[m] for t, m in zip(trajs, masks)])
    adv = np.concatenate([np.asarray(a)[m] for a, m in zip(advantages, masks)])
    lengths = np.array([len(t.output_ids) for t in trajs])
    return {
        "reward/mean": float(np.mean([t.reward for t in trajs])),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "advantage/mean": float(adv.mean()),
        "advantage/std": float(adv.std()),
        "advantage/min": float(adv.min()),
        "advantage/max": float(adv.max()),
        "tokens": float(sum(t.length for t in trajs)),
    }


def loss_metrics(stats: Sequence[dict], losses: Sequence[float], updates: Sequence[dict]) -> dict:
    """Combine host copies of per-micro-batch stats, per-minibatch losses and update metrics.

    ``loss`` and ``grad_norm`` are means over the minibatch updates; ``lr`` is the last one used.
    """
    summary = summarize_stats(functools.reduce(accumulate_stats, stats))
    out = {key: summary[name] for name, key in _LOSS_KEYS.items() if name in summary}
    out["loss"] = float(np.mean(losses))
    out["grad_norm"] = float(np.mean([u["grad_norm"] for u in updates]))
    out["lr"] = float(updates[-1]["lr"])
    return out
