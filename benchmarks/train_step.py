"""Train-step throughput: our jitted JAX step against a PyTorch step of the same model.

Both sides train the same weights (our random init, exported to Hugging Face format and loaded
by transformers) on the same [rows, T] token batch: one sequence of T tokens per row, a prompt
followed by trained response tokens, standard PPO clipped loss at temperature 1 with the token
mean over response tokens, global-norm clipping and AdamW. Ours runs the whole
``Trainer.train_on_batch`` (advantages, packing, device transfer, one optimiser update); the
decoupled-PPO line adds the proximal log-prob forward pass. Each measurement runs in a fresh
process (XLA's and PyTorch's idle worker threads would otherwise compete), and the sequence of
measurements is repeated ``--repeats`` times; the table shows medians. MFU counts model FLOPs
(6 x matmul params + 6 x layers x T x q-dim per token: causal attention, half the full score
matrix, the usual convention) against a measured large fp32 matmul.

Usage: python benchmarks/train_step.py [--rows 8 --seq 512 --steps 5 --repeats 2]
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


def step_flops(cfg: ModelConfig, rows: int, seq: int) -> float:
    """Model FLOPs of one forward + backward over rows x seq tokens."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matmul_params = L * (d * (q + 2 * kv) + q * d + 3 * d * f) + d * cfg.vocab_size
    per_token = 6 * matmul_params + 6 * L * seq * q  # causal: half of 12 * L * seq * q
    return per_token * rows * seq


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> list[TrajectoryGroup]:
    """``rows`` trajectories of exactly ``seq`` tokens in groups of 4, rewards 0..3."""
    rng = np.random.RandomState(seed)
    groups = []
    for g in range(rows // 4):
        trajs = []
        for k in range(4):
            out = rng.randint(0, vocab, size=seq - PROMPT)
            trajs.append(Trajectory(rng.randint(0, vocab, size=PROMPT), out,
                                    np.full(len(out), -np.log(vocab)) + 0.1 * rng.randn(len(out)),
                                    np.zeros(len(out)), reward=float(k)))
        groups.append(TrajectoryGroup(f"g{g}", trajs))
    return groups


def ours_step(model_dir: str, groups, rows: int, seq: int, decoupled: bool, scan_layers: bool):
    """A compiled ``Trainer.train_on_batch`` on ``groups`` as a no-argument callable."""
    loss = LossConfig() if decoupled else LossConfig(policy_loss="ppo")
    cfg = TrainerConfig(
        model_path=model_dir, lr=1e-5, ppo_n_minibatches=1, grad_clip=CLIP, loss=loss,
        scan_layers=scan_layers,
        micro_batch=MicroBatchConfig(token_budget=rows * seq, row_buckets=(seq, rows * seq)),
        advantage=AdvantageConfig(estimator="grpo"),
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train_on_batch(groups)
    return lambda: trainer.train_on_batch(groups)


def torch_step(model_dir: str, groups, threads: int):
    """A PyTorch forward + PPO loss + backward + clip + AdamW step as a callable."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_jax.rl import trajectory_advantages

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    trajs = [t for g in groups for t in g.trajectories]
    adv = trajectory_advantages(groups, AdvantageConfig())
    tokens = torch.tensor(np.stack([np.concatenate([t.prompt_ids, t.output_ids]) for t in trajs]),
                          dtype=torch.long)
    behav = torch.tensor(np.stack([t.behav_logprobs for t in trajs]))
    advantages = torch.tensor(np.stack(adv))

    def step():
        logits = model(tokens).logits[:, PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, PROMPT:, None])[..., 0]
        ratio = torch.exp(logp - behav)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        loss = -surrogate.mean()
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
        groups = make_batch(args.rows, args.seq, cfg.vocab_size)
        with tempfile.TemporaryDirectory() as model_dir:
            export_hf(init_model(cfg, seed=0), model_dir)
            if kind == "torch_ppo":
                step = torch_step(model_dir, groups, args.torch_threads)
            else:
                step = ours_step(model_dir, groups, args.rows, args.seq,
                                 decoupled=kind.startswith("jax_decoupled"),
                                 scan_layers=not kind.endswith("_unrolled"))
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
    tokens, flops = args.rows * args.seq, step_flops(cfg, args.rows, args.seq)
    peak = max(samples["peak"])
    print(f"model: {MODEL}")
    print(f"batch: {args.rows} rows x {args.seq} tokens = {tokens} tokens/step; "
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
