"""The RL phase, run by the leader process: rollout servers up and at the trainer's version,
held-out accuracy before, the asynchronous loop (with local servers supervised), accuracy after.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path

from areal_jax.config import ConfigError, to_dict
from areal_jax.controller.evaluation import evaluate, with_text
from areal_jax.controller.ledger import RunLedger
from areal_jax.controller.loop import RLLoop
from areal_jax.controller.prepare import run_id
from areal_jax.controller.progress import TrainingProgress
from areal_jax.controller.servers import rollout_servers, servers_spare_the_trainer
from areal_jax.controller.servers import Supervision, sync_servers
from areal_jax.controller.sketches import first_batch_sketches
from areal_jax.data.dataset import PromptDataset
from areal_jax.experiment import ExperimentConfig
from areal_jax.files import read_json, write_atomic, write_jsonl
from areal_jax.metrics import METRICS_FILE, MetricsLogger, read_records
from areal_jax.models import ModelConfig
from areal_jax.trainer.publish import discard_exports_after

log = logging.getLogger(__name__)

BEFORE_RL_FILE = "eval_before_rl.json"
RESULTS_FILE = "results.json"


def _print_eval(label: str, result: dict) -> None:
    failed = int(result.get("eval/failed", 0))
    notes = f"; {failed} requests failed and are not counted" if failed else ""
    if reward_failures := int(result.get("eval/reward_failures", 0)):
        notes += f"; the reward failed on {reward_failures} answers, scored 0"
    print(f"{label}: accuracy {result['eval/accuracy']:.3f} on "
          f"{int(result['eval/num_prompts'])} held-out prompts "
          f"(mean response {result['eval/response_length']:.1f} tokens{notes})", flush=True)


def _eval_settings(cfg: ExperimentConfig) -> dict:
    """What an accuracy depends on besides the model."""
    e = cfg.eval
    return {"dataset": to_dict(e.dataset), "max_prompts": e.max_prompts,
            "temperature": e.temperature, "max_new_tokens": e.max_new_tokens}


async def _accuracy_before_rl(cfg: ExperimentConfig, version: int, run_eval,
                              metrics_log) -> dict:
    """Held-out accuracy before RL: measured once, and read back when the run resumes (the
    model it measured is no longer served then: a change of the eval settings since is
    reported, not measured again)."""
    path = Path(cfg.run_dir) / BEFORE_RL_FILE
    settings = _eval_settings(cfg)
    if path.is_file():
        before = read_json(path, numbers=("version", "eval/accuracy", "eval/num_prompts",
                                           "eval/response_length"))
        recorded = before.pop("settings", None)
        _print_eval(f"held-out accuracy at version {before['version']:.0f} (before RL, recorded)",
                    before)
        if recorded is not None and recorded != settings:  # (None: recorded before settings)
            print(f"warning: the accuracy before RL was measured with other eval settings "
                  f"({recorded}) than this run's ({settings}): the two are not comparable",
                  flush=True)
        return before
    before = {**await run_eval(version), "version": float(version)}
    write_atomic(path, json.dumps({**before, "settings": settings}))
    metrics_log.log(version, before)
    _print_eval(f"held-out accuracy at version {version} (before RL)", before)
    return before


def recorded_results(cfg: ExperimentConfig, version: int) -> dict | None:
    """What the finished run recorded (``results.json``) if it finished at ``version`` with
    this config's eval settings, else None (a run stopped in its last evaluation records
    nothing; other eval settings measure again)."""
    try:
        results = read_json(Path(cfg.run_dir) / RESULTS_FILE)
    except (ConfigError, OSError):
        return None
    if results.get("version") != version or results.get("eval_settings") != _eval_settings(cfg):
        return None
    return results


def report_finished(cfg: ExperimentConfig, results: dict) -> None:
    """Say that the run has nothing left to train, with the accuracies it recorded."""
    print(f"the run in {cfg.run_dir} already reached version {results['version']} "
          f"(schedule.total_steps: {cfg.schedule.total_steps}): nothing to train; raise "
          f"schedule.total_steps to train on, or measure a version with areal-jax eval",
          flush=True)
    for key, label in (("before", "before RL"), ("after", "after RL")):
        if key in results:
            _print_eval(f"held-out accuracy at version "
                        f"{results[key].get('version', results['version']):.0f} "
                        f"({label}, recorded)", results[key])


SAMPLES_DIR = "eval_samples"


def write_samples(run_dir: Path, version: int, records: list[dict]) -> None:
    """Keep the held-out answers of ``version`` (``evaluation.with_text`` records) in
    ``eval_samples/v{version}.jsonl``: what the reward was given, to read when it surprises."""
    directory = run_dir / SAMPLES_DIR
    directory.mkdir(exist_ok=True)
    write_jsonl(directory / f"v{version}.jsonl", records)


def _evaluation_logged(run_dir: Path, step: int) -> bool:
    """Whether the run's metrics already hold an evaluation at ``step`` (a finished run,
    resumed, keeps its records up to its last version)."""
    path = run_dir / METRICS_FILE
    return path.is_file() and any(r is not None and r["step"] == step and "eval/accuracy" in r
                                  for _, _, r in read_records(path))


def check_trajectories_fit(cfg: ExperimentConfig, prompt_lengths) -> None:
    """Refuse an RL run whose longest prompt, answered with ``sampling.max_new_tokens``, would
    not fit one micro-batch: its step would fail mid-run, after the work before it. A run with
    no RL versions (``schedule.total_steps: 0``) trains no trajectory and passes."""
    if cfg.schedule.total_steps == 0:
        return
    mb = cfg.trainer.micro_batch
    budget = mb.token_budget
    longest_prompt = max(prompt_lengths, default=0)
    longest = longest_prompt + cfg.sampling.max_new_tokens
    if longest > budget:
        raise ConfigError(
            f"trainer.micro_batch.token_budget ({budget}) is below the longest training prompt "
            f"({longest_prompt} tokens) + sampling.max_new_tokens "
            f"({cfg.sampling.max_new_tokens}) = {longest}: such a trajectory fits no micro-batch; "
            f"raise the token budget or lower sampling.max_new_tokens (or, in a new run "
            f"directory, dataset.max_prompt_tokens: longer prompts are dropped)")
    if mb.mode == "fixed":  # a batch of such trajectories splits evenly: rows of `longest`
        per_minibatch = -(-cfg.schedule.batch_size * cfg.sampling.group_size
                          // cfg.trainer.ppo_n_minibatches)
        rows = -(-per_minibatch // mb.num_micro_batches)
        if rows * longest > budget:
            raise ConfigError(
                f"trainer.micro_batch.mode fixed: a batch whose trajectories all take "
                f"{longest} tokens (the longest training prompt + sampling.max_new_tokens) puts "
                f"{rows} of them in a micro-batch ({per_minibatch} per minibatch in "
                f"trainer.micro_batch.num_micro_batches = {mb.num_micro_batches}), "
                f"{rows * longest} padded tokens, more than trainer.micro_batch.token_budget "
                f"({budget}); raise num_micro_batches or the token budget")


def compiles_first_batches(cfg: ExperimentConfig, in_helper: bool) -> bool:
    """Whether the trainer compiles sketched first batches while the servers start and the
    held-out set is evaluated (``compile_first_batches``; unset: where that takes no CPU from
    the servers, or where the trainer compiles ahead ``in_helper``, the helper process at the
    lowest CPU priority; on a shared CPU a compile at the trainer's priority would only move
    the work, not save it)."""
    if cfg.compile_first_batches is not None:
        return cfg.compile_first_batches
    return cfg.rollout.remote or servers_spare_the_trainer(cfg) or in_helper


async def run_rl(cfg: ExperimentConfig, trainer, tokenizer, train_set: PromptDataset,
                 eval_items: list, progress: TrainingProgress, extra: dict | None) -> dict:
    """Train on ``train_set`` to ``schedule.total_steps`` versions, evaluating on
    ``eval_items``; returns the before/after evaluations.

    ``trainer`` is the leader's handle (a ``TrainerGroup`` across processes); ``extra`` is the
    loop state restored from a checkpoint, or None on a fresh start.
    """
    run_dir = Path(cfg.run_dir)
    log.info("training prompts: %d (%d dropped as too long)", len(train_set), train_set.num_dropped)
    prompt_lengths = [len(item.prompt_ids) for item in train_set]

    version = trainer.version
    snapshot = trainer.snapshot_for_publish()
    discard_exports_after(snapshot.exports_dir, version)  # what a killed run trained past it
    published = snapshot.write()
    push = cfg.rollout.weights_transport == "push"
    results: dict = {}
    in_helper = trainer.compiles_ahead_in_helper
    sketching = compiles_first_batches(cfg, in_helper)
    if sketching:
        sp = cfg.sampling
        trainer.compile_ahead_for(first_batch_sketches(
            prompt_lengths, cfg.schedule.batch_size, sp.group_size, sp.max_new_tokens, cfg.seed))
    with RunLedger(run_dir / "ledger.jsonl") as ledger, \
            MetricsLogger(run_dir, resume_from_step=version + 1) as metrics_log, \
            contextlib.ExitStack() as waiting:
        # Until the loop starts the trainer waits: the thread compiles meanwhile (the helper
        # needs no window; should it end, its jobs wait for the loop's, unless asked for).
        if sketching and (cfg.compile_first_batches or not in_helper):
            waiting.enter_context(trainer.idle())
        task = progress.start_phase("connecting to the rollout servers" if cfg.rollout.remote
                                    else "starting rollout servers", None)
        async with rollout_servers(
                cfg, published, version, training=prompt_lengths,
                held_out=[len(item.prompt_ids) for item in eval_items],
                vocab_size=ModelConfig.from_pretrained(published).vocab_size,
                run_id=run_id(cfg)) as (pool, servers), \
                Supervision(servers, published.parent) as supervision:
            # local servers that exit are restarted, in the evaluations as in the loop
            progress.end_phase(task)
            if servers is None:
                await sync_servers(pool, published, version, cfg)
            else:
                pool.record_weights(published, version, push)

            evaluated: dict[int, dict] = {}  # by version, the loop's evaluations included

            async def run_eval(step: int, token_counts: list[int] | None = None,
                               strict: bool = False, shown: bool = False) -> dict:
                """Evaluate the served version ``step``; its answers go to
                ``eval_samples/v{step}.jsonl`` (``shown``: with a progress bar)."""
                if not eval_items:
                    return {}
                task = progress.start_phase(f"evaluating version {step}", len(eval_items),
                                            lines=10) if shown else None
                answers: list[dict] = []
                try:
                    evaluated[step] = await evaluate(
                        pool, eval_items, cfg.eval.dataset.reward,
                        max_new_tokens=cfg.eval.max_new_tokens,
                        temperature=cfg.eval.temperature, token_counts=token_counts,
                        strict=strict, samples=answers,
                        on_answer=None if task is None else lambda: progress.advance(task))
                finally:
                    if task is not None:
                        progress.end_phase(task)
                write_samples(run_dir, step, with_text(answers, tokenizer))
                return evaluated[step]

            if eval_items:
                token_counts: list[int] = []
                # before RL, an evaluation answering nothing stops the run (nothing trained yet)
                results["before"] = await supervision.run(_accuracy_before_rl(
                    cfg, version,
                    functools.partial(run_eval, token_counts=token_counts, strict=True,
                                      shown=True),
                    metrics_log))
                token_counts = [n for n in token_counts if n >= 2]  # answers, not bare prompts
                if sketching and token_counts:  # the policy's own lengths: a better forecast
                    trainer.expect_lengths(token_counts,
                                           cfg.schedule.batch_size * cfg.sampling.group_size)
            waiting.close()
            loop = RLLoop(cfg, trainer, pool, train_set.iterator(), {i.id: i for i in train_set},
                          on_step=None, on_eval=run_eval if eval_items else None,
                          ledger=ledger)
            if extra:
                loop.load_state_dict(extra)
            total = cfg.schedule.total_steps
            task = progress.start_phase("RL", total, completed=version)

            def on_step(step: int, m: dict) -> None:
                metrics_log.log(step, m)
                progress.advance(task, m)

            def on_evaluated(step: int, m: dict) -> None:  # beside the steps after it
                metrics_log.log(step, m, late=True)
                if step != total:  # that one is printed as the accuracy after RL
                    _print_eval(f"held-out accuracy at version {step}", m)

            loop.on_step, loop.on_evaluated = on_step, on_evaluated
            await supervision.run(loop.run(total, trainer.save))
            progress.end_phase(task)
            if eval_items:
                final = trainer.version
                if final in evaluated and final != version:  # the loop's own, at its last step
                    results["after"] = evaluated[final]
                else:
                    results["after"] = await supervision.run(run_eval(final, shown=True))
                    if not _evaluation_logged(run_dir, final):  # a finished run run again
                        metrics_log.log(final, results["after"])
                _print_eval(f"held-out accuracy at version {final} (after RL)",
                            results["after"])
    results.update(version=trainer.version, eval_settings=_eval_settings(cfg))
    return results
