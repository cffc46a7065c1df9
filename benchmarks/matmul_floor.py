"""The matrix products of decode and of a train step, XLA against PyTorch on this CPU.

The engine and the train step are mostly weight products; how fast this machine's XLA runs
each product shape bounds how fast either can go, whatever the program around them does. For
each shape, XLA runs a chain of ``--chain`` products with distinct weights inside one jitted
program (dispatch amortised, as inside the decode or train program), PyTorch the same chain
of ``torch.mm`` calls with ``--torch-threads`` threads. The sides alternate per shape and
repetition; medians are shown. XLA's side is the model's own ``models.dense``: products
accumulated into fp32, the result cast to the operands' type. ``--dtypes``: fp32, and bf16 on
both sides (PyTorch's CPU bf16 products use AMX units where the CPU has them).

Shapes: the 23M decode model's projections at 32 rows (the engine's batch) and 8 rows, and the
train-step benchmark model's products at 4096 tokens in the three forms of a training step:
forward ``x @ w``, input gradient ``g @ w.T`` and weight gradient ``x.T @ g``.

Usage: PYTHONPATH=. python benchmarks/matmul_floor.py [--reps 5 --chain 16 --dtypes float32
       bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from areal_jax.models.dense import dense
from benchmarks.paper.common import machine, with_load_after

RESULTS = Path(__file__).parent / "results" / "matmul_floor.md"
# (label, rows, in, out, form): form "fwd" x[rows, in] @ w[in, out]; "dx" g[rows, out] @ w.T;
# "dw" x.T @ g, contracting the rows.
SHAPES = [
    ("decode 23M, q/o", 32, 512, 512, "fwd"),
    ("decode 23M, gate/up", 32, 512, 1408, "fwd"),
    ("decode 23M, down", 32, 1408, 512, "fwd"),
    ("decode 23M, gate/up, 8 rows", 8, 512, 1408, "fwd"),
    ("train 4.2M, gate/up", 4096, 256, 768, "fwd"),
    ("train 4.2M, gate/up", 4096, 256, 768, "dx"),
    ("train 4.2M, gate/up", 4096, 256, 768, "dw"),
    ("train 4.2M, q/o", 4096, 256, 256, "dw"),
    ("train 4.2M, head", 4096, 256, 2048, "fwd"),
]


def operands(rows: int, n_in: int, n_out: int, form: str, chain: int, rng):
    """(activation, [weight] * chain) as float32 numpy arrays for one product form."""
    left = (rows, n_out) if form == "dx" else (rows, n_in)
    weight = {"fwd": (n_in, n_out), "dx": (n_in, n_out), "dw": (rows, n_out)}[form]
    a = rng.standard_normal(left, dtype=np.float32)
    return a, [rng.standard_normal(weight, dtype=np.float32) for _ in range(chain)]


def product(form: str, matmul):
    """The product of one form through ``matmul(a, b)`` (``.T`` works on both sides)."""
    return {"fwd": lambda a, w: matmul(a, w), "dx": lambda a, w: matmul(a, w.T),
            "dw": lambda a, w: matmul(a.T, w)}[form]


def sides(form: str, dtype: str, a: np.ndarray, ws: list[np.ndarray]):
    """(XLA, PyTorch) callables computing the ``form`` product of ``a`` with each weight in
    ``dtype``; XLA in one jitted program through the model's own ``dense`` (fp32 accumulation,
    result in ``dtype``). Both are checked to agree first."""
    ours_op, op = product(form, dense), product(form, lambda a, b: a @ b)
    run = jax.jit(lambda a, ws: [ours_op(a, w) for w in ws])
    ja, jws = jnp.asarray(a, dtype), [jnp.asarray(w, dtype) for w in ws]
    to_torch = lambda x: torch.from_numpy(x).to(getattr(torch, dtype))  # noqa: E731
    ta, tws = to_torch(a), [to_torch(w) for w in ws]

    def ours():
        return jax.block_until_ready(run(ja, jws))

    def theirs():
        return [op(ta, w) for w in tws]

    tol = 1e-3 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(ours()[-1], np.float32),
                               theirs()[-1].float().numpy(), rtol=tol, atol=tol * 10)
    return ours, theirs


def seconds(fn, reps: int = 5) -> float:
    """Median wall time of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chain", type=int, default=16, help="products per timed program")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                        default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    before = machine()
    rng = np.random.default_rng(0)
    cases = []
    for dtype in args.dtypes:
        for label, rows, n_in, n_out, form in SHAPES:
            ours, theirs = sides(form, dtype, *operands(rows, n_in, n_out, form, args.chain, rng))
            cases.append((label, rows, n_in, n_out, form, dtype, ours, theirs, [], []))
    for _ in range(args.reps):
        for *_, ours, theirs, ours_s, theirs_s in cases:
            ours_s.append(seconds(ours))
            theirs_s.append(seconds(theirs))
    m = with_load_after(before)
    lines = [
        "# Matrix products: XLA against PyTorch on this CPU", "",
        f"Command: `PYTHONPATH=. python benchmarks/matmul_floor.py --reps {args.reps} "
        f"--chain {args.chain} --dtypes {' '.join(args.dtypes)}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['machine']}; 1-minute load average "
        f"{m['load_before']:.1f} before, {m['load_avg_1m']:.1f} after; jax {jax.__version__}, "
        f"torch {torch.__version__} ({args.torch_threads} threads). Chains of {args.chain} "
        f"products per timed call, median of {args.reps} alternating rounds (each round the "
        f"median of 5 calls).", "",
        "| product | rows | in | out | form | dtype | XLA GFLOP/s | PyTorch GFLOP/s "
        "| XLA / PyTorch |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for label, rows, n_in, n_out, form, dtype, _, _, ours_s, theirs_s in cases:
        flops = 2 * rows * n_in * n_out * args.chain
        ours_r, theirs_r = (flops / statistics.median(s) / 1e9 for s in (ours_s, theirs_s))
        lines.append(f"| {label} | {rows} | {n_in} | {n_out} | {form} | {dtype} | {ours_r:.0f} | "
                     f"{theirs_r:.0f} | {ours_r / theirs_r:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
