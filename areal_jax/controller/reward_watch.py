"""Reward calls that fail (raise, time out, crash their worker) score 0 on the rollout servers;
here they are counted per batch, shown on the console, and a run whose reward fails in every
call is stopped instead of training on its zeros. Groups whose samples all scored alike are
counted, and batches without a learning signal (every advantage the run's estimator gives their
rewards is zero: under GRPO, every group scored alike) are reported several in a row. Before
SFT, the user's own reward is tried on the first training rows (``try_reward_before_sft``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from areal_jax.config import ConfigError
from areal_jax.experiment import ExperimentConfig
from areal_jax.rl import AdvantageConfig, compute_advantages
from areal_jax.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

FAILING_BATCHES_TO_STOP = 3  # batches in a row whose every reward call failed
MAX_DISTINCT_WARNINGS = 5  # distinct failure messages shown; the metrics count the rest
FLAT_BATCHES_TO_WARN = 3  # batches in a row without a learning signal
MAX_FLAT_WARNINGS = 3  # such warnings per run; the metric counts the rest


class RewardFailingError(RuntimeError):
    """The reward failed in every call of several batches in a row."""


class RewardWatch:
    """Counts the failed reward calls the servers report with each group (see
    ``group_from_proto``)."""

    def __init__(self, reward: str, failing_batches_to_stop: int = FAILING_BATCHES_TO_STOP,
                 advantage: AdvantageConfig | None = None):
        """``advantage``: the trainer's options, whose estimator says whether a batch's rewards
        carry a learning signal (default GRPO's); with a reward shaping that depends on more
        than the reward (an overlong penalty, a KL penalty) no batch is called flat."""
        self.reward = reward
        self.advantage = advantage or AdvantageConfig()
        self.failing_batches_to_stop = failing_batches_to_stop
        self._failing_batches = 0
        self._shown: set[str] = set()
        self._flat_batches = 0
        self._flat_warnings = 0

    def observe(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """Metrics of one batch's reward failures and of its groups whose rewards were all
        equal; warns on each new failure message and when ``FLAT_BATCHES_TO_WARN`` batches in a
        row had no learning signal, and raises ``RewardFailingError`` once
        ``failing_batches_to_stop`` batches in a row had every reward call fail."""
        failed = sum(g.metadata.get("reward_failures", 0) for g in groups)
        calls = sum(g.metadata.get("reward_calls", 0) for g in groups)
        errors = [g.metadata["reward_error"] for g in groups if g.metadata.get("reward_error")]
        for error in errors:
            if error not in self._shown and len(self._shown) < MAX_DISTINCT_WARNINGS:
                self._shown.add(error)
                log.warning("reward %r failed in %d of %d calls of this batch (scored 0): %s",
                            self.reward, failed, calls, error)
        self._failing_batches = self._failing_batches + 1 if failed >= calls > 0 else 0
        if self._failing_batches >= self.failing_batches_to_stop:
            raise RewardFailingError(
                f"reward {self.reward!r} failed in every call of {self._failing_batches} "
                f"batches in a row, so training would only learn from zeros; the first "
                f"failure: {errors[0] if errors else '?'} (the first failures are in the rollout "
                "servers' logs, <run_dir>/logs/rollout_server_*.log for local servers)")
        flat = sum(len({t.reward for t in g.trajectories}) <= 1 for g in groups)
        self._warn_if_flat(groups)
        return {"reward/failed_calls": float(failed),
                "reward/failed_fraction": failed / calls if calls else 0.0,
                "reward/flat_groups": flat / len(groups) if groups else 0.0}

    def _without_signal(self, groups: Sequence[TrajectoryGroup]) -> bool:
        """Whether every advantage of the batch's rewards is zero under the run's estimator."""
        a = self.advantage
        if not groups or a.overlong_window > 0 or a.kl_beta > 0:
            return False
        rewards = [[t.reward for t in g.trajectories] for g in groups]
        try:
            advantages = compute_advantages(a.estimator, rewards, eps=a.eps,
                                            group_std=a.group_std)
        except ValueError:  # the trainer's own step reports what its estimator refuses
            return False
        return all(not x.any() for x in advantages)

    def _warn_if_flat(self, groups: Sequence[TrajectoryGroup]) -> None:
        """Count batches in a row without a learning signal; say so when there are
        ``FLAT_BATCHES_TO_WARN`` of them (at most ``MAX_FLAT_WARNINGS`` times)."""
        self._flat_batches = self._flat_batches + 1 if self._without_signal(groups) else 0
        if self._flat_batches != FLAT_BATCHES_TO_WARN or self._flat_warnings >= MAX_FLAT_WARNINGS:
            return
        self._flat_warnings += 1
        rewards = sorted({t.reward for g in groups for t in g.trajectories})
        shown = ", ".join(f"{r:g}" for r in rewards[:5]) + (", ..." if len(rewards) > 5 else "")
        log.warning(
            "no learning signal in the last %d batches: the rewards (seen: %s) give every "
            "sample a zero advantage under the %s estimator (for GRPO: in every group all "
            "samples scored alike), so the policy does not move; check what reward %r "
            "returns on a few completions (the held-out answers and their rewards are in the "
            "run's eval_samples/, or areal-jax eval --samples FILE), that the prompts ask for what "
            "it reads, and that the task is neither out of the model's reach nor already "
            "solved", self._flat_batches, shown,
            self.advantage.estimator, self.reward)


REWARD_TRIAL_ROWS = 4  # training rows the user's own reward is tried on before SFT


def try_reward_before_sft(cfg: ExperimentConfig, train_set) -> None:
    """Before SFT (hours on a real model, after which the data settings are fixed in the run
    directory): call the training set's reward, when it is the user's own (a path, or a name
    ``rollout.server.rewards.custom`` lists), on the first training rows as the rollout
    servers will (the row's metadata as text), each row's SFT response as the answer, in a
    reward worker. A reward failing on every row, each with an error of its own (none timing
    out: a short timeout on a loaded machine is no fault of the reward), is refused naming its
    first error (it would fail the evaluation after SFT, or every training call); otherwise a
    failure is warned of, as it is with remote servers, which run the reward in their own
    environment."""
    import asyncio
    import itertools

    from areal_jax.controller.servers import listed_rewards, with_dataset_reward
    from areal_jax.data.dataset import metadata_text
    from areal_jax.rewards import RewardPool

    reward = cfg.dataset.reward
    custom = with_dataset_reward(listed_rewards(cfg), reward)
    if reward not in custom:  # a built-in or registered reward: tested with the project
        return
    rows = list(itertools.islice(train_set, REWARD_TRIAL_ROWS))
    key = cfg.sft.response_key
    timeout = float(cfg.rollout.server.get("rewards", {}).get("timeout_s", 30.0))

    async def trials(pool: RewardPool) -> list[tuple[str | None, bool]]:
        """(the failure if any, whether it timed out) per row."""
        results = []
        for item in rows:
            timeouts = pool.num_timeouts
            _, error = await pool.score_with_error(
                reward, metadata_text(item.metadata[key]),
                {k: metadata_text(v) for k, v in item.metadata.items()})
            results.append((error, pool.num_timeouts > timeouts))
        return results

    # each failure is said below: the pool's own lines only at debug level
    with RewardPool(num_workers=1, timeout_s=timeout, custom=custom,
                    failure_level=logging.DEBUG) as pool:
        results = asyncio.run(trials(pool))
    failed = [(item.id, error) for item, (error, _) in zip(rows, results) if error is not None]
    if not failed:
        return
    how = (f"called as the rollout servers call it on training rows "
           f"{', '.join(i.id for i in rows)} (each row's metadata, its {key!r} as the answer)")
    timed_out = any(late for _, late in results)
    if len(failed) == len(rows) and not timed_out and not cfg.rollout.remote:
        raise ConfigError(f"dataset.reward: {reward!r} failed on every one of the first "
                          f"{len(rows)} training rows, {how}; the first error: {failed[0][1]}. "
                          "Fix it (or dataset.metadata_fields) before SFT runs")
    log.warning("dataset.reward: %r failed on %d of the first %d training rows, %s; row %s: "
                "%s%s", reward, len(failed), len(rows), how, *failed[0],
                " (the remote rollout servers run it in their own environment)"
                if cfg.rollout.remote else "")
