"""Shared parts of the paper benchmarks: `areal-jax train` runs pinned to disjoint CPUs, the
machine and its load, medians and spreads, and the JSON + markdown reports they write.

Every script writes ``<name>.json`` (all samples, the machine, the command, and ``summary`` rows
for ``summary.py``), ``<name>.md`` and PNG plots into ``benchmarks/results/paper/`` (``--out``).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "paper"
CONFIG = "configs/bench_longtail.yaml"


def add_out_argument(parser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory for the JSON, markdown and PNG results")


def add_run_arguments(parser, name: str, versions: int) -> None:
    """The options every RL benchmark takes: config, seeds, versions, CPU split, work and
    results directories, config overrides."""
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--versions", type=int, default=versions, help="RL versions per run")
    parser.add_argument("--trainer-cpus", type=int, default=None,
                        help="CPUs for the trainer (the rest go to the rollout server)")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/paper") / name)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every run, SFT included")
    parser.add_argument("--resume", action="store_true",
                        help="read back finished runs of the same command in --work-dir instead "
                             "of rerunning them (unfinished ones are started afresh)")
    add_out_argument(parser)


def machine(accelerator: bool = False) -> dict:
    """What the numbers were measured on, and how loaded it was (1-minute load average);
    ``accelerator``: also the JAX accelerators, for a benchmark that computes in this process
    (asking starts JAX's backend, which on a GPU claims memory)."""
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    info = {"cpu": model, "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0],
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    devices = _accelerators() if accelerator else None
    return {**info, "accelerator": devices} if devices else info


def _accelerators() -> str | None:
    """This process's JAX accelerators, e.g. ``1 x NVIDIA H200``; None on a CPU backend."""
    import jax

    if jax.default_backend() == "cpu":
        return None
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].device_kind}"


def _machine_words(info: dict) -> str:
    host = f"{info['cpu']}, {info['cores']} cores"
    return f"{info['accelerator']} on {host}" if info.get("accelerator") else host


def with_load_after(before: dict) -> dict:
    """``before`` (from ``machine()`` at the start) with the load average at the end added."""
    return {**before, "load_before": before["load_avg_1m"], "load_avg_1m": os.getloadavg()[0]}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_split(trainer_cpus: int | None) -> tuple[list[int], list[int]]:
    """This process's CPUs split into (trainer, rollout server); half each by default."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("these benchmarks pin trainer and rollout server to separate CPUs: "
                         f"they need at least 2, this process may use {len(cpus)}")
    n = trainer_cpus or len(cpus) // 2
    if not 1 <= n < len(cpus):
        raise SystemExit(f"--trainer-cpus must be in [1, {len(cpus) - 1}], got {n}")
    return cpus[:n], cpus[n:]


def pinning(trainer: list[int], rollout: list[int]) -> list[str]:
    """Overrides that put the trainer and one local rollout server on the given CPUs."""
    return [f"trainer_cpus={json.dumps(trainer)}", f"rollout.cpu_sets={json.dumps([rollout])}",
            "rollout.num_local_servers=1"]


def _argv(command: str, config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "areal_jax.cli", command, "--config", config, *overrides]


def areal_jax(command: str, config: str, overrides: list[str], log: Path,
              timeout_s: float | None = None, env: dict[str, str] | None = None) -> float:
    """Run ``areal-jax COMMAND --config CONFIG OVERRIDES`` (output to ``log``), with ``env``
    added to the environment; wall seconds."""
    argv = _argv(command, config, overrides)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + shlex.join(argv) + "\n")
        out.flush()
        proc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s, check=False, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"areal-jax {command} failed (exit {proc.returncode}); "
                           f"log {log}:\n{tail}")
    return time.monotonic() - start


def warm_start(config: str, work: Path, overrides: list[str]) -> Path:
    """The SFT model every RL run of a benchmark starts from (built once, then reused)."""
    work = work.resolve()
    run_dir = work / "sft"
    out = run_dir / "sft_model"
    if not (out / "config.json").is_file():
        print(f"SFT warm start into {out} ...", flush=True)
        areal_jax("sft", config, [f"run_dir={run_dir}", *overrides], work / "logs" / "sft.log")
    return out


def _finished_by(run_dir: Path, log: Path, argv: list[str]) -> bool:
    """Whether ``run_dir`` holds a finished run started by exactly ``argv``."""
    if not (run_dir / "results.json").is_file() or not log.is_file():
        return False
    with log.open() as f:
        return f.readline().rstrip("\n") == "$ " + shlex.join(argv)


def rl_run(config: str, run_dir: Path, start: Path, overrides: list[str],
           resume: bool = False) -> dict:
    """One RL run from ``start``: its training rows, eval rows and results.json. The run must
    start fresh, unless ``resume`` and ``run_dir`` holds a finished run of the same command
    (read back as it is; an unfinished one is deleted and rerun). The run's compilation cache
    is its own (``$AREAL_JAX_CACHE_DIR`` in the run directory), empty at the start as on a first
    run: with a shared one, the runs earlier in the order would compile for the later ones."""
    run_dir = run_dir.resolve()
    overrides = [*overrides, f"run_dir={run_dir}", f"model_path={start}", "sft.steps=0"]
    log = run_dir.parent / "logs" / f"{run_dir.name}.log"
    if resume and _finished_by(run_dir, log, _argv("train", config, overrides)):
        print(f"{run_dir.name}: finished earlier, read back", flush=True)
    else:
        if run_dir.exists():
            if not resume:
                raise SystemExit(f"{run_dir} exists: a benchmark run must start fresh (use a "
                                 "new --work-dir, delete it, or --resume)")
            shutil.rmtree(run_dir)
        areal_jax("train", config, overrides, log,
                  env={"AREAL_JAX_CACHE_DIR": str(run_dir / "xla_cache")})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return {"train": [r for r in rows if "timing/train_s" in r],
            "eval": [r for r in rows if "eval/accuracy" in r],
            "results": json.loads((run_dir / "results.json").read_text())}


def steady_rate(train_rows: list[dict], skip: int) -> dict:
    """Versions and trained tokens per hour, and each side's idle fraction, after the first
    ``skip`` versions (compilation and the servers' first requests are left out). Tokens per
    hour tell a faster step from a smaller batch: the asynchronous loop's batches gather the
    groups that finish first, which are shorter.

    Trainer idle: its time waiting for a batch (``timing/wait_s``) over the wall time.
    Rollout idle: 1 - the mean of ``rollout/busy_fraction`` (slots the gate let it fill).
    Compile share: the seconds the loop compiled on its critical path (``timing/compile_s``)
    over the wall time; versions per hour without them is what the rate would be if every
    program had been compiled off the critical path (derived, not measured).
    Overlap bound (read on a synchronous run, where the sides take turns): the cycle without
    compilation over the longer of the trainer's busy time without compilation and its wait
    for rollouts; the speed-up a perfect overlap of the two sides would give (derived).
    """
    rows = sorted(train_rows, key=lambda r: r["step"])
    if len(rows) < skip + 2:
        raise ValueError(f"{len(rows)} versions recorded: need more than skip + 1 = {skip + 1}")
    first, steady = rows[skip], rows[skip + 1:]
    seconds = steady[-1]["wall_time"] - first["wall_time"]
    busy = [r["rollout/busy_fraction"] for r in steady
            if r.get("rollout/busy_fraction") is not None]
    compile_s = sum(r.get("timing/compile_s", 0.0) for r in steady)
    wait_s = sum(r["timing/wait_s"] for r in steady)
    busy_s = sum(r["timing/train_s"] for r in steady) - compile_s
    return {"versions_per_hour": 3600 * len(steady) / seconds,
            "overlap_bound": (seconds - compile_s) / max(busy_s, wait_s),
            "compile_share": compile_s / seconds,
            "versions_per_hour_without_compile": 3600 * len(steady) / (seconds - compile_s),
            "tokens_per_hour": 3600 * sum(r["tokens"] for r in steady) / seconds,
            "trainer_idle": wait_s / seconds,
            "rollout_idle": 1 - statistics.mean(busy) if busy else float("nan"),
            "staleness_p90": statistics.mean(r.get("staleness/p90") or 0.0 for r in steady)}


def spread(values: list[float]) -> dict:
    """Median, minimum, maximum and count of ``values`` (NaN-free)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt_spread(s: dict, digits: int = 2) -> str:
    """``median [min-max]`` (just the median for one sample)."""
    m = f"{s['median']:.{digits}f}"
    return m if s["n"] == 1 else f"{m} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """How this script was started, as a command to run from the repository root."""
    script = Path(sys.argv[0]).resolve().relative_to(ROOT)
    return shlex.join(["PYTHONPATH=.", "python", str(script), *sys.argv[1:]])


def arguments(args) -> dict[str, str]:
    """The script's parsed arguments, JSON-able."""
    return {k: str(v) for k, v in vars(args).items()}


def summary_row(figure: str, paper: str, goal: str, measured: str, info: dict) -> dict:
    """One line of the paper-claims table (``summary.py``)."""
    return {"figure": figure, "paper": paper, "goal": goal, "measured": measured,
            "machine": _machine_words(info),
            "load": f"{info['load_before']:.2f} -> {info['load_avg_1m']:.2f}",
            "command": command_line()}


def write_report(out: Path, name: str, title: str, sections: list[str], payload: dict) -> Path:
    """``out/<name>.md`` (title, command, machine, sections) and ``out/<name>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    info = payload["machine"]
    head = (f"# {title}\n\nCommand: `{command_line()}`\n\nMachine: {_machine_words(info)} "
            f"({info['machine']}), Python {info['python']}, measured "
            f"{info['date_utc']} UTC; 1-minute load average {info['load_before']:.2f} before, "
            f"{info['load_avg_1m']:.2f} after.")
    (out / f"{name}.md").write_text("\n\n".join([head, *sections]) + "\n")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    print("\n\n".join(sections))
    print(f"written to {out / name}.md, .json")
    return out / f"{name}.md"


def save_figure(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG, folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def bar_plot(path: Path, title: str, ylabel: str, bars: dict[str, dict],
             reference: tuple[float, str] | None = None) -> Path:
    """Bars of medians with min-max whiskers (``bars``: label -> ``spread``), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(bars)
    medians = [bars[k]["median"] for k in labels]
    low = [m - bars[k]["min"] for k, m in zip(labels, medians)]
    high = [bars[k]["max"] - m for k, m in zip(labels, medians)]
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 2, 3.5), dpi=100)
    ax.bar(labels, medians, yerr=[low, high], capsize=4, color="#4878a8")
    if reference is not None:
        ax.axhline(reference[0], color="#c44e52", linestyle="--", label=reference[1])
        ax.legend()
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return save_figure(fig, path)
