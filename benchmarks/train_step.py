"""Train-step throughput: our jitted JAX step against a PyTorch step of the same model.

Both sides train the same weights (our random init, exported to Hugging Face format and loaded
by transformers) on the same sequences (a prompt followed by trained response tokens), with the
standard PPO clipped loss at temperature 1, the token mean over response tokens, global-norm
clipping and AdamW. ``--lengths fixed`` (default): one sequence of exactly T tokens per row, the
same [rows, T] batch on both sides. ``--lengths rl``: long-tailed response lengths, as RL
samples have; we pack them into rows of T, PyTorch runs them padded to the longest (transformers
has no variable-length attention on CPU). Ours runs the whole
``Trainer.train_on_batch`` (advantages, packing, device transfer, one optimiser update); the
decoupled-PPO line adds the proximal log-prob forward pass. Each measurement runs in a fresh
process (XLA's and PyTorch's idle worker threads would otherwise compete), and the sequence of
measurements is repeated ``--repeats`` times; the table shows medians. MFU counts model FLOPs
(6 x matmul params + 6 x layers x T x q-dim per token: causal attention, half the full score
matrix, the usual convention) against a measured large fp32 matmul. ``--dtype bfloat16``
computes in bf16 on both sides with fp32 master weights and optimiser state (ours:
``trainer.dtype``; PyTorch: CPU autocast to bf16 around the forward pass).

Usage: python benchmarks/train_step.py [--rows 8 --seq 512 --steps 5 --repeats 2 --lengths fixed
       --dtype float32]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import ModelConfig, export_hf, init_model
from areal_jax.rl import AdvantageConfig, LossConfig, MicroBatchConfig
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trajectory import Trajectory, TrajectoryGroup

MODEL = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}  # fmt: skip
PROMPT = 64
CLIP = 1.0


def matmul_peak_flops(n: int = 2048, reps: int = 10) -> float:
    """Measured fp32 FLOP/s of a jitted [n, n] @ [n, n] on this machine (best of ``reps``)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, a).block_until_ready()
    best = min(_timed(lambda: f(a, a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_flops(cfg: ModelConfig, groups: list[TrajectoryGroup]) -> float:
    """Model FLOPs of one forward + backward over the batch's real (unpadded) sequences."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matmul_params = L * (d * (q + 2 * kv) + q * d + 3 * d * f) + d * cfg.vocab_size
    total = 0.0
    for t in (t for g in groups for t in g.trajectories):
        n = len(t.prompt_ids) + len(t.output_ids)
        total += (6 * matmul_params + 6 * L * n * q) * n  # causal: half of 12 * L * n * q
    return total


def make_batch(rows: int, seq: int, vocab: int, lengths: str = "fixed",
               seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of 4 trajectories (rewards 0..3), a ``PROMPT``-token prompt each.

    ``fixed``: ``rows`` trajectories of exactly ``seq`` tokens. ``rl``: response lengths
    log-uniform from 16 to ``seq - PROMPT`` (long-tailed, as RL samples are), as many groups as
    fill about 90% of ``rows x seq`` tokens.
    """
    rng = np.random.RandomState(seed)
    groups, total = [], 0
    while (len(groups) < rows // 4) if lengths == "fixed" else (total < 0.9 * rows * seq):
        g = len(groups)
        trajs = []
        for k in range(4):
            n = seq - PROMPT
            if lengths == "rl":
                n = int(np.exp(rng.uniform(np.log(16), np.log(seq - PROMPT))))
            total += PROMPT + n
            out = rng.randint(0, vocab, size=n)
            trajs.append(Trajectory(rng.randint(0, vocab, size=PROMPT), out,
                                    np.full(len(out), -np.log(vocab)) + 0.1 * rng.randn(len(out)),
                                    np.zeros(len(out)), reward=float(k)))
        groups.append(TrajectoryGroup(f"g{g}", trajs))
    return groups


def ours_step(model_dir: str, groups, rows: int, seq: int, decoupled: bool, scan_layers: bool,
              dtype: str):
    """A compiled ``Trainer.train_on_batch`` on ``groups`` as a no-argument callable."""
    loss = LossConfig() if decoupled else LossConfig(policy_loss="ppo")
    cfg = TrainerConfig(
        model_path=model_dir, lr=1e-5, ppo_n_minibatches=1, grad_clip=CLIP, loss=loss,
        scan_layers=scan_layers, dtype=dtype,
        micro_batch=MicroBatchConfig(token_budget=rows * seq, row_buckets=(seq, rows * seq)),
        advantage=AdvantageConfig(estimator="grpo"),
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train_on_batch(groups)
    return lambda: trainer.train_on_batch(groups)


def torch_step(model_dir: str, groups, threads: int, dtype: str, device: str = "cpu"):
    """A PyTorch forward + PPO loss + backward + clip + AdamW step on ``device`` as a callable
    (fp32 weights; the forward under autocast when ``dtype`` is bfloat16)."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from areal_jax.rl import trajectory_advantages

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    trajs = [t for g in groups for t in g.trajectories]
    adv = trajectory_advantages(groups, AdvantageConfig())
    # One padded [N, longest] batch (what a PyTorch CPU user without varlen kernels runs).
    width = max(len(t.output_ids) for t in trajs)

    def padded(rows, dtype, prefix=0):
        rows = [np.pad(r, (0, prefix + width - len(r))) for r in rows]
        return torch.tensor(np.stack(rows), dtype=dtype, device=device)

    tokens = padded([np.concatenate([t.prompt_ids, t.output_ids]) for t in trajs], torch.long,
                    prefix=PROMPT)
    mask = padded([np.ones(len(t.output_ids)) for t in trajs], torch.float32)
    attention_mask = torch.nn.functional.pad(mask.long(), (PROMPT, 0), value=1)
    behav = padded([t.behav_logprobs for t in trajs], torch.float32)
    advantages = padded(adv, torch.float32)

    def autocast():
        if dtype == "bfloat16":
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        with autocast():
            logits = model(tokens, attention_mask=attention_mask).logits
        logits = logits[:, PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, PROMPT:, None])[..., 0]
        ratio = torch.exp(logp - behav)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        loss = -(surrogate * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


def jax_attention_step(cfg: ModelConfig, rows: int, seq: int):
    """Our attention kernel's forward + backward over one layer as a callable."""
    from areal_jax.models.attention import packed_attention

    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(rows, seq, cfg.num_heads, cfg.head_dim), jnp.float32)
    kv = jnp.asarray(rng.randn(rows, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    segments = jnp.ones((rows, seq), jnp.int32)
    grad = jax.jit(jax.grad(lambda q, k, v: packed_attention(q, k, v, segments).sum(),
                            argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, kv, kv))
    return lambda: jax.block_until_ready(grad(q, kv, kv))


def torch_attention_step(cfg: ModelConfig, rows: int, seq: int, threads: int):
    """PyTorch causal SDPA forward + backward over one layer as a callable."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, cfg.num_heads, seq, cfg.head_dim, generator=gen, requires_grad=True)
    kv = torch.randn(rows, cfg.num_heads, seq, cfg.head_dim, generator=gen, requires_grad=True)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        out.sum().backward()

    step()
    return step


def measure(kind: str, args: argparse.Namespace) -> list[float]:
    """Seconds of ``args.steps`` steps of one kind after warm-up (FLOP/s for "peak")."""
    if kind == "peak":
        return [matmul_peak_flops()]
    cfg = ModelConfig.from_hf_dict(MODEL)
    if kind == "jax_attention":
        step = jax_attention_step(cfg, args.rows, args.seq)
    elif kind == "torch_attention":
        step = torch_attention_step(cfg, args.rows, args.seq, args.torch_threads)
    else:
        groups = make_batch(args.rows, args.seq, cfg.vocab_size, args.lengths)
        with tempfile.TemporaryDirectory() as model_dir:
            export_hf(init_model(cfg, seed=0), model_dir)
            if kind == "torch_ppo":
                step = torch_step(model_dir, groups, args.torch_threads, args.dtype)
            else:
                step = ours_step(model_dir, groups, args.rows, args.seq,
                                 decoupled=kind.startswith("jax_decoupled"),
                                 scan_layers=not kind.endswith("_unrolled"), dtype=args.dtype)
    return [_timed(step) for _ in range(args.steps)]


def in_fresh_process(kind: str, args: argparse.Namespace) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(measure, kind, args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--lengths", choices=["fixed", "rl"], default="fixed",
                        help="fixed: every sequence --seq tokens; rl: long-tailed response "
                             "lengths (packed by us, padded to the longest by PyTorch)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of both sides (weights and optimiser stay fp32)")
    args = parser.parse_args()
    if args.rows % 4:
        parser.error("--rows must be a multiple of 4 (groups of 4)")
    kinds = ("peak", "jax_ppo", "jax_ppo_unrolled", "torch_ppo", "jax_decoupled",
             "jax_decoupled_unrolled", "jax_attention", "torch_attention")
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            samples[kind] += in_fresh_process(kind, args)
    sec = {k: statistics.median(v) for k, v in samples.items()}

    cfg = ModelConfig.from_hf_dict(MODEL)
    groups = make_batch(args.rows, args.seq, cfg.vocab_size, args.lengths)
    lengths = [len(t.prompt_ids) + len(t.output_ids) for g in groups for t in g.trajectories]
    tokens, flops = sum(lengths), step_flops(cfg, groups)
    peak = max(samples["peak"])
    print(f"model: {MODEL}")
    print(f"compute dtype: {args.dtype} (fp32 weights and optimiser state on both sides)")
    print(f"batch ({args.lengths} lengths): {len(lengths)} sequences of {min(lengths)} to "
          f"{max(lengths)} tokens, {tokens} tokens/step (rows of {args.seq} for packing); "
          f"{args.repeats} x {args.steps} timed steps per line, median")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s; "
          f"model FLOPs per step (fwd+bwd): {flops / 1e9:.1f} GFLOP")
    print(f"{'step':42s} {'s/step':>8s} {'tokens/s':>9s} {'MFU':>6s} {'vs torch':>8s}")
    names = {"jax_ppo": "jax, PPO (scan_layers: true, default)",
             "jax_ppo_unrolled": "jax, PPO (scan_layers: false)",
             "jax_decoupled": "jax, decoupled PPO + proximal forward",
             "jax_decoupled_unrolled": "jax, decoupled PPO (scan_layers: false)",
             "torch_ppo": f"torch {args.torch_threads} threads, PPO"}  # fmt: skip
    for kind, name in names.items():
        t = sec[kind]
        print(f"{name:42s} {t:8.3f} {tokens / t:9.0f} {flops / t / peak:6.1%} "
              f"{sec['torch_ppo'] / t:7.2f}x")
    print(f"attention fwd+bwd, all {cfg.num_layers} layers: "
          f"jax {sec['jax_attention'] * cfg.num_layers:.3f} s, "
          f"torch SDPA (causal) {sec['torch_attention'] * cfg.num_layers:.3f} s")


if __name__ == "__main__":
    main()
