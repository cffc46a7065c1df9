"""Held-out accuracy over the first versions of RL, synchronous against asynchronous, measured
after each run from the exports it kept, so the measurement does not slow the run.

Every run starts from one SFT warm start of ``--config`` (default: the quickstart), trains
``--versions`` versions with trainer and rollout server pinned to disjoint CPUs and every
version's export kept (``trainer.export_keep_every=1``); then ``areal-jax eval --curve``
measures greedy accuracy on the held-out prompts at each version. Settings: ``sync`` (generation
paused while the trainer trains, η = 0) and ``async η=E`` for each ``--etas``. Reports, per
version, the median [min-max] accuracy over seeds for each setting, the median held-out
response length, and the training reward of the version's batch.

Usage: PYTHONPATH=. python benchmarks/paper/early_curve.py [--seeds 0 1 2 --versions 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.paper import common
from benchmarks.paper.async_vs_sync import settings


def curve_plot(path: Path, curves: dict[str, dict[int, list[float]]],
               rewards: dict[str, dict[int, list[float]]]) -> Path:
    """Median held-out accuracy (min-max band) and median training reward per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for name, by_version in curves.items():
        v = sorted(by_version)
        axes[0].plot(v, [statistics.median(by_version[x]) for x in v], marker="o", label=name)
        axes[0].fill_between(v, [min(by_version[x]) for x in v], [max(by_version[x]) for x in v],
                             alpha=0.15)
    for name, by_version in rewards.items():
        v = sorted(by_version)
        axes[1].plot(v, [statistics.median(by_version[x]) for x in v], marker=".", label=name)
    axes[0].set(title="Held-out accuracy (median, min-max over seeds)", xlabel="version",
                ylabel="accuracy")
    axes[1].set(title="Training reward of the batch (median over seeds)", xlabel="version",
                ylabel="reward")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    return common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_arguments(parser, "early_curve", versions=10)
    parser.set_defaults(config="configs/quickstart.yaml")
    parser.add_argument("--etas", type=int, nargs="+", default=[2])
    args = parser.parse_args()

    before = common.machine()
    pins = common.pinning(*common.cpu_split(args.trainer_cpus))
    start = common.warm_start(args.config, args.work_dir, args.set)
    curves: dict[str, dict[int, list[float]]] = {name: {} for name in settings(args.etas)}
    lengths: dict[str, dict[int, list[float]]] = {name: {} for name in settings(args.etas)}
    rewards: dict[str, dict[int, list[float]]] = {name: {} for name in settings(args.etas)}
    for seed in args.seeds:
        for name, schedule in settings(args.etas).items():
            tag = name.replace(" ", "_").replace("η=", "eta")
            run_dir = (args.work_dir / f"{tag}_seed{seed}").resolve()
            overrides = [*args.set, *pins, *schedule, f"schedule.total_steps={args.versions}",
                         f"seed={seed}", f"trainer.seed={seed}", "checkpoint_every=0",
                         "trainer.export_keep_every=1"]
            run = common.rl_run(args.config, run_dir, start, overrides, args.resume)
            common.areal_jax("eval", args.config, ["--curve", str(run_dir), *overrides,
                                                   f"run_dir={run_dir}"],
                             args.work_dir / "logs" / f"{run_dir.name}_curve.log")
            for line in (run_dir / "eval_curve.jsonl").read_text().splitlines():
                row = json.loads(line)
                curves[name].setdefault(int(row["step"]), []).append(row["eval/accuracy"])
                lengths[name].setdefault(int(row["step"]), []).append(
                    row["eval/response_length"])
            for row in run["train"]:
                rewards[name].setdefault(int(row["step"]), []).append(row["reward/mean"])
            first, last = min(curves[name]), max(curves[name])
            print(f"{name}, seed {seed}: accuracy {curves[name][first][-1]:.3f} at version "
                  f"{first} -> {curves[name][last][-1]:.3f} at version {last}", flush=True)

    names = list(curves)
    versions = sorted(set().union(*(c.keys() for c in curves.values())))
    def medians(series, n, v, digits):
        return f"{statistics.median(series[n][v]):.{digits}f}" if v in series[n] else "-"

    rows = [[v, *[common.fmt_spread(common.spread(curves[n][v]), 3) if v in curves[n] else "-"
                  for n in names],
             *[medians(lengths, n, v, 1) for n in names],
             *[medians(rewards, n, v, 3) for n in names]] for v in versions]
    info = common.with_load_after(before)
    png = curve_plot(args.out / "early_curve.png", curves, rewards)
    sections = [
        f"## Held-out accuracy by version ({len(args.seeds)} seed(s); median [min-max]), "
        "held-out response length and the training reward of each version's batch "
        "(medians)\n\n"
        + common.table(["version", *[f"accuracy, {n}" for n in names],
                        *[f"response tokens, {n}" for n in names],
                        *[f"train reward, {n}" for n in names]], rows),
        f"![curves]({png.name})",
    ]
    payload = {"machine": info, "args": common.arguments(args), "curves": curves,
               "lengths": lengths, "rewards": rewards}
    common.write_report(args.out, "early_curve", "Accuracy over the first versions of RL",
                        sections, payload)


if __name__ == "__main__":
    main()
