"""Train-step throughput: our jitted JAX step against a PyTorch step of the same model.

Both sides train the same weights (our random init, exported to Hugging Face format and loaded
by transformers) on the same [rows, T] token batch: one sequence of T tokens per row, a prompt
followed by trained response tokens, standard PPO clipped loss at temperature 1 with the token
mean over response tokens, global-norm clipping and AdamW. Ours runs the whole
``Trainer.train_on_batch`` (advantages, packing, device transfer, one optimiser update); the
decoupled-PPO line adds the proximal log-prob forward pass. Steps are timed round-robin
(median of ``--steps`` rounds) so that load from other processes hits every side alike. MFU
counts model FLOPs
(6 x matmul params + 12 x layers x T x q-dim per token, i.e. full non-causal attention
scores, as our kernel computes them) against a measured large fp32 matmul.

Usage: python benchmarks/train_step.py [--rows 8 --seq 512 --steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

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
    per_token = 6 * matmul_params + 12 * L * seq * q
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


def ours_step(model_dir: str, groups, rows: int, seq: int, decoupled: bool):
    """A compiled ``Trainer.train_on_batch`` on ``groups`` as a no-argument callable."""
    loss = LossConfig() if decoupled else LossConfig(policy_loss="ppo")
    cfg = TrainerConfig(
        model_path=model_dir, lr=1e-5, ppo_n_minibatches=1, grad_clip=CLIP, loss=loss,
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


def interleaved_medians(steps: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each callable, timed round-robin so machine load hits all alike."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def time_attention(cfg: ModelConfig, rows: int, seq: int, steps: int, threads: int) -> dict:
    """Seconds of attention forward + backward over all layers: our kernel and torch SDPA."""
    import torch

    from areal_jax.models.attention import attend, packed_causal_mask

    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(rows, seq, cfg.num_heads, cfg.head_dim), jnp.float32)
    kv = jnp.asarray(rng.randn(rows, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    mask = packed_causal_mask(jnp.ones((rows, seq), jnp.int32))
    grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v, mask).sum(), argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, kv, kv))
    ours = statistics.median(_timed(lambda: jax.block_until_ready(grad(q, kv, kv)))
                             for _ in range(steps))  # fmt: skip

    torch.set_num_threads(threads)
    group = cfg.num_heads // cfg.num_kv_heads
    qt = torch.tensor(np.asarray(q)).transpose(1, 2).requires_grad_()
    kt = torch.tensor(np.asarray(kv)).transpose(1, 2).repeat_interleave(group, 1).requires_grad_()

    def sdpa_step():
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, kt, is_causal=True)
        out.sum().backward()

    sdpa_step()
    theirs = statistics.median(_timed(sdpa_step) for _ in range(steps))
    return {"jax": ours * cfg.num_layers, "torch": theirs * cfg.num_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()
    if args.rows % 4:
        parser.error("--rows must be a multiple of 4 (groups of 4)")
    cfg = ModelConfig.from_hf_dict(MODEL)
    tokens = args.rows * args.seq
    flops = step_flops(cfg, args.rows, args.seq)
    groups = make_batch(args.rows, args.seq, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as model_dir:
        export_hf(init_model(cfg, seed=0), model_dir)
        steps = {
            "jax, PPO (this repo)": ours_step(model_dir, groups, args.rows, args.seq, False),
            "jax, decoupled PPO + proximal forward": ours_step(
                model_dir, groups, args.rows, args.seq, True),
            f"torch {args.torch_threads} threads, PPO": torch_step(
                model_dir, groups, args.torch_threads),
        }  # fmt: skip
        results = interleaved_medians(steps, args.steps)
    peak = matmul_peak_flops()
    print(f"model: {MODEL}")
    print(f"batch: {args.rows} rows x {args.seq} tokens = {tokens} tokens/step; "
          f"devices: {jax.devices()}")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s; "
          f"model FLOPs per step (fwd+bwd): {flops / 1e9:.1f} GFLOP")
    print(f"{'step':42s} {'s/step':>8s} {'tokens/s':>9s} {'MFU':>6s}")
    for name, sec in results.items():
        print(f"{name:42s} {sec:8.3f} {tokens / sec:9.0f} {flops / sec / peak:6.1%}")
    attention = time_attention(cfg, args.rows, args.seq, args.steps, args.torch_threads)
    print(f"of which attention fwd+bwd, all layers: jax {attention['jax']:.3f} s, "
          f"torch SDPA (causal) {attention['torch']:.3f} s")


if __name__ == "__main__":
    main()
