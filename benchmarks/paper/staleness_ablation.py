"""Staleness ablation: final accuracy for each bound η, standard PPO against decoupled PPO.

Every run trains the same number of versions from one SFT warm start on the long-tailed task,
asynchronously with ``schedule.max_staleness=η`` (η = 0 reproduces synchronous training's
data) and ``trainer.loss.policy_loss`` = ``ppo`` (π_prox := π_behav) or ``decoupled_ppo``;
held-out accuracy is measured every ``--eval-every`` versions. ``schedule.max_in_flight`` is
raised to (η + 1) x batch size so the gate, not the in-flight cap, bounds staleness; the
staleness actually trained on (p90 of per-token staleness) is reported, since it only reaches
η when generation outpaces training. Paper (AIME24, standard -> decoupled): η=1 41.8 -> 42.1,
η=2 40.0 -> 41.8, η=4 23.3 -> 42.2, η=8 35.7 -> 41.0, η=16 35.8 -> 38.7; η=0: 42.0.

Usage: PYTHONPATH=. python benchmarks/paper/staleness_ablation.py [--seeds 0 1 2 --versions 60]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from areal_jax.config import load_config
from areal_jax.experiment import ExperimentConfig
from benchmarks.paper import common

LOSSES = {"ppo": "standard PPO", "decoupled_ppo": "decoupled PPO"}
# What the loss saw, per run: the median over its steps of these step metrics.
LOSS_SEEN = {"clip_frac": "ppo/clip_frac", "capped_frac": "ppo/behav_capped_frac",
             "grad_norm": "grad_norm"}
PAPER = {0: (42.0, 42.0), 1: (41.8, 42.1), 2: (40.0, 41.8), 4: (23.3, 42.2), 8: (35.7, 41.0),
         16: (35.8, 38.7)}  # AIME24 accuracy (%), (standard PPO, decoupled PPO)


def curves_plot(path: Path, runs: dict, etas: list[int], stats: dict, losses: list[str]) -> Path:
    """Final accuracy vs η per objective, and the median learning curve of each run kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(losses), figsize=(5 * (1 + len(losses)), 4), dpi=100)
    for loss in losses:
        label = LOSSES[loss]
        s = [stats[(loss, e)] for e in etas]
        med = [x["median"] for x in s]
        axes[0].errorbar([str(e) for e in etas], med, capsize=4, marker="o", label=label,
                         yerr=[[m - x["min"] for m, x in zip(med, s)],
                               [x["max"] - m for m, x in zip(med, s)]])
    axes[0].set(title="Final held-out accuracy (median, min-max)", xlabel="η", ylabel="accuracy")
    axes[0].legend()
    for ax, loss in zip(axes[1:], losses):
        label = LOSSES[loss]
        for e in etas:
            by_step: dict[int, list[float]] = {}
            for run in runs[f"{loss} η={e}"]:
                for step, acc in run["curve"]:
                    by_step.setdefault(step, []).append(acc)
            steps = sorted(by_step)
            ax.plot(steps, [statistics.median(by_step[s]) for s in steps], marker=".",
                    label=f"η={e}")
        ax.set(title=f"{label}: accuracy (median over seeds)", xlabel="version",
               ylabel="accuracy")
        ax.legend()
    return common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_arguments(parser, "staleness_ablation", versions=60)
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--eval-every", type=int, default=10, help="versions between evals")
    args = parser.parse_args()

    before = common.machine()
    cfg = load_config(ExperimentConfig, args.config, args.set)
    pins = common.pinning(*common.cpu_split(args.trainer_cpus))
    start = common.warm_start(args.config, args.work_dir, args.set)
    runs: dict[str, list[dict]] = {f"{loss} η={e}": [] for loss in args.losses for e in args.etas}
    for seed in args.seeds:
        for loss in args.losses:
            for eta in args.etas:
                in_flight = max(cfg.schedule.max_in_flight, (eta + 1) * cfg.schedule.batch_size)
                overrides = [*args.set, *pins, "schedule.mode=async",
                             f"schedule.max_staleness={eta}", f"schedule.max_in_flight={in_flight}",
                             f"trainer.loss.policy_loss={loss}",
                             f"schedule.total_steps={args.versions}", f"seed={seed}",
                             f"trainer.seed={seed}", "checkpoint_every=0",
                             f"eval.every_steps={args.eval_every}"]
                run = common.rl_run(args.config, args.work_dir / f"{loss}_eta{eta}_seed{seed}",
                                    start, overrides, args.resume)
                curve = sorted({int(r["step"]): r["eval/accuracy"] for r in run["eval"]}.items())
                train = run["train"]
                result = {"seed": seed, "accuracy": run["results"]["after"]["eval/accuracy"],
                          "curve": curve,
                          "staleness_p90": statistics.mean(r["staleness/p90"] for r in train),
                          "reward_last10": statistics.mean(r["reward/mean"] for r in train[-10:]),
                          **{name: statistics.median(r[key] for r in train)
                             for name, key in LOSS_SEEN.items()}}
                runs[f"{loss} η={eta}"].append(result)
                print(f"{LOSSES[loss]}, η={eta}, seed {seed}: accuracy {result['accuracy']:.3f}, "
                      f"staleness p90 {result['staleness_p90']:.1f}", flush=True)

    stats = {(loss, e): common.spread([r["accuracy"] for r in runs[f"{loss} η={e}"]])
             for loss in args.losses for e in args.etas}
    rows = []
    for e in args.etas:
        row = [str(e)]
        for loss in LOSSES:
            if loss in args.losses:
                rs = runs[f"{loss} η={e}"]
                row += [common.fmt_spread(stats[(loss, e)], 3),
                        f"{statistics.median(r['staleness_p90'] for r in rs):.1f}"]
            else:
                row += ["-", "-"]
        paper = PAPER.get(e)
        row.append(f"{paper[0]} -> {paper[1]}" if paper else "-")
        rows.append(row)
    info = common.with_load_after(before)
    png = curves_plot(args.out / "staleness_ablation.png", runs, args.etas, stats, args.losses)
    measured = "; ".join(
        f"{LOSSES[loss]} η={e}: {common.fmt_spread(stats[(loss, e)], 3)}"
        for loss in args.losses for e in sorted({min(args.etas), max(args.etas)}))
    sections = [
        f"## Final held-out accuracy ({len(args.seeds)} seed(s), {args.versions} versions; "
        "median [min-max])\n\n" + common.table(
            ["η", "standard PPO", "staleness p90", "decoupled PPO", "staleness p90",
             "paper AIME24 % (standard -> decoupled)"], rows),
        "## What the loss saw (per run the median over its steps, then the median [min-max] "
        "over seeds)\n\n" + common.table(
            ["η", "objective", "clipped tokens %", "behaviour weight over the cap %",
             "gradient norm"],
            [[str(e), LOSSES[loss],
              *(common.fmt_spread(common.spread([scale * r[name] for r in runs[f"{loss} η={e}"]]),
                                  digits)
                for name, scale, digits in (("clip_frac", 100, 3), ("capped_frac", 100, 3),
                                            ("grad_norm", 1, 3)))]
             for e in args.etas for loss in args.losses])
        + "\n\nStandard PPO clips its ratio to the behaviour policy; the decoupled objective "
        "its ratio to the proximal policy (1 at a batch's first update) and weights each token "
        "by π_prox / π_behav, dropping tokens whose weight is over the cap.",
        f"![curves]({png.name})",
    ]
    payload = {"machine": info, "args": common.arguments(args),
               "runs": runs, "stats": {f"{k[0]} η={k[1]}": v for k, v in stats.items()},
               "summary": [common.summary_row(
                   "staleness ablation, standard vs decoupled PPO (paper Table 2)",
                   "standard PPO falls with η (η=4: 23.3 vs 42.2); decoupled holds to η=8 "
                   "(41.0 vs 42.0 at η=0)",
                   "decoupled at η <= 8 within seed spread of η=0; standard PPO below it "
                   "at large η", measured, info)]}
    common.write_report(args.out, "staleness_ablation", "Staleness ablation", sections, payload)


if __name__ == "__main__":
    main()
