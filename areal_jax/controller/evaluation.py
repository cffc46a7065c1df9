"""Held-out accuracy of the policy the rollout servers serve now."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import numpy as np

from areal_jax.controller.requests import rollout_request
from areal_jax.controller.rollout_pool import RequestFailedError, RolloutPool
from areal_jax.data.dataset import PromptItem, metadata_text
from areal_jax.protocol import finish_reason_from_proto

log = logging.getLogger(__name__)
_rounds = itertools.count()


class EvaluationFailedError(RuntimeError):
    """Every request of a held-out evaluation failed: its accuracy would measure nothing."""


async def evaluate(pool: RolloutPool, items: list[PromptItem], reward: str, *,
                   max_new_tokens: int, temperature: float = 0.0,
                   token_counts: list[int] | None = None, strict: bool = True,
                   samples: list[dict] | None = None,
                   on_answer: Callable[[], None] | None = None) -> dict[str, float]:
    """Mean reward (accuracy for 0/1 rewards) and response length, one sample per prompt.

    ``token_counts``, if given, is extended with each answer's prompt + response tokens;
    ``samples`` with one record per answered prompt, in order (``answer_record``);
    ``on_answer`` is called as each request ends (a progress display).
    Requests that failed (answered with an error, or failing on the servers after their
    attempts) are counted and the first one's error logged; when every one failed, or every
    reward call failed (a reward reading a metadata key the data does not map: every answer
    scored 0), ``EvaluationFailedError`` names that error (e.g. a server that does not know the
    reward), unless not ``strict`` (an evaluation inside a run: the accuracy is then NaN, or 0,
    and the run goes on to its next checkpoint)."""
    tag = next(_rounds)
    start = time.monotonic()
    futures = [
        pool.submit(rollout_request(item, f"eval-{tag}-{i}", reward, 1, max_new_tokens,
                                    temperature, seed=i))
        for i, item in enumerate(items)
    ]
    if on_answer is not None:
        for future in futures:
            future.add_done_callback(lambda _: on_answer())
    groups = await asyncio.gather(*futures, return_exceptions=True)
    rewards, lengths, failed, first_error = [], [], 0, None
    reward_calls, reward_failures, first_reward_error = 0, 0, None
    for item, group in zip(items, groups):
        if isinstance(group, RequestFailedError):  # failed on the servers after its attempts
            failed += 1
            first_error = first_error or str(group)
            continue
        if isinstance(group, BaseException):  # no server left, ...: not this request's failure
            raise group
        if group.HasField("error"):
            failed += 1
            first_error = first_error or (
                f"{group.error.message}" + (f" (field {group.error.field})"
                                            if group.error.field else ""))
            continue
        if group.reward_failures:
            if not reward_failures:
                first_reward_error = group.reward_error
                log.warning("evaluation: reward %r failed (scored 0): %s", reward,
                            first_reward_error)
            reward_failures += group.reward_failures
        reward_calls += group.reward_calls
        for t in group.trajectories:
            rewards.append(t.reward)
            lengths.append(len(t.output_ids))
            if token_counts is not None:
                token_counts.append(len(group.prompt_ids) + len(t.output_ids))
            if samples is not None:
                samples.append(answer_record(item, t))
    if failed and failed == len(items) and strict:
        raise EvaluationFailedError(
            f"every one of the {failed} held-out evaluation requests failed; the first: "
            f"{first_error}")
    if reward_calls and reward_failures == reward_calls and strict:
        raise EvaluationFailedError(
            f"every one of the {reward_calls} reward calls of the held-out evaluation failed "
            f"(reward {reward!r}), so every answer would score 0; the first: "
            f"{first_reward_error}")
    if failed:
        log.warning("evaluation: %d of %d requests failed and are not counted; the first: %s",
                    failed, len(items), first_error)
    seconds = time.monotonic() - start
    log.info("evaluated %d held-out prompts in %.1f s", len(items), seconds)
    return {
        "eval/accuracy": float(np.mean(rewards)) if rewards else float("nan"),
        "eval/response_length": float(np.mean(lengths)) if lengths else float("nan"),
        "eval/num_prompts": float(len(rewards)),
        "eval/failed": float(failed),
        "eval/reward_failures": float(reward_failures),
        "eval/seconds": seconds,
    }


def answer_record(item: PromptItem, trajectory) -> dict:
    """What a held-out answer was: the prompt's id and text, the answer's token ids, its
    reward and how it ended (``with_text`` adds the answer's text)."""
    return {"id": item.id, "prompt": item.prompt_text, "output_ids": list(trajectory.output_ids),
            "reward": trajectory.reward,
            "finish_reason": finish_reason_from_proto(trajectory.finish_reason),
            "metadata": {k: metadata_text(v) for k, v in item.metadata.items()}}


def with_text(records: list[dict], tokenizer) -> list[dict]:
    """``records`` (``answer_record``) with each answer decoded as ``completion`` (special
    tokens kept: an end-of-sequence shows where the answer stopped) and as ``reward_input``,
    the text the single-turn workflow gives the reward (special tokens removed)."""
    return [{**{k: v for k, v in r.items() if k != "output_ids"},
             "completion": tokenizer.decode(r["output_ids"], skip_special_tokens=False),
             "reward_input": tokenizer.decode(r["output_ids"], skip_special_tokens=True),
             "output_tokens": len(r["output_ids"])} for r in records]


def held_out_items(cfg, tokenizer) -> list[PromptItem]:
    """The first ``eval.max_prompts`` prompts of ``eval.dataset`` (none when it is unset)."""
    from areal_jax.controller.prepare import dataset_config
    from areal_jax.data.dataset import PromptDataset

    if cfg.eval.dataset is None:
        return []
    items = PromptDataset(dataset_config(cfg.eval.dataset, cfg.run_dir), tokenizer,
                          "eval.dataset")
    return list(items)[: cfg.eval.max_prompts]


async def evaluate_checkpoint(cfg, model_path) -> dict:
    """Held-out accuracy of the HF checkpoint ``model_path`` through local or given servers."""
    return (await evaluate_checkpoints(cfg, [model_path]))[0]


async def evaluate_checkpoints(cfg, model_paths, samples: list[list[dict]] | None = None
                               ) -> list[dict]:
    """Held-out accuracy of each HF checkpoint of ``model_paths``, in order, through one set of
    local or given rollout servers (the weights swapped between checkpoints). The tokenizer is
    the first checkpoint's. ``samples``, if given, gets each checkpoint's answers
    (``answer_record`` with their text, ``with_text``)."""
    from pathlib import Path

    from areal_jax.config import ConfigError
    from areal_jax.models import ModelConfig
    from areal_jax.models.tokenizer import load_tokenizer
    from areal_jax.controller.prepare import prepare_data
    from areal_jax.controller.servers import check_local_engine_context, rollout_servers

    if cfg.eval.dataset is None:
        raise ConfigError("eval.dataset: required for evaluation")
    if not model_paths:
        raise ValueError("model_paths is empty: nothing to evaluate")
    prepare_data(cfg)
    paths = [Path(p) for p in model_paths]
    vocab_size = ModelConfig.from_pretrained(paths[0]).vocab_size
    tokenizer = load_tokenizer(paths[0], vocab_size)
    items = held_out_items(cfg, tokenizer)
    lengths = [len(i.prompt_ids) for i in items]
    check_local_engine_context(cfg, paths[0], held_out=lengths)
    results = []
    async with rollout_servers(cfg, paths[0], 0, with_trainer=False, held_out=lengths,
                               vocab_size=vocab_size,
                               run_id=f"eval-{uuid.uuid4().hex}") as (pool, servers):
        version = 0
        if servers is None:
            version = max(s.version for s in (await pool.statuses()).values()) + 1
            await pool.update_weights(paths[0], version)
        for i, path in enumerate(paths):
            if i > 0:
                version += 1
                await pool.update_weights(path, version)
            # strict on the first only: a setup error shows there, and a later checkpoint whose
            # answers all fail the reward (a collapsed policy) is a point of the curve
            answers: list[dict] = []
            results.append(await evaluate(pool, items, cfg.eval.dataset.reward,
                                          max_new_tokens=cfg.eval.max_new_tokens,
                                          temperature=cfg.eval.temperature, strict=i == 0,
                                          samples=answers))
            if samples is not None:
                samples.append(with_text(answers, tokenizer))
    return results
