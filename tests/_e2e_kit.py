"""The tiny experiment the end-to-end `areal-jax train` tests run: a tiny model, the synthetic
task, a short SFT warm start and one local JAX rollout server."""

from pathlib import Path

import yaml


def tiny_experiment(tmp_path: Path, total_steps: int) -> dict:
    return {
        "run_dir": str(tmp_path / "run"),
        "model_path": "tiny",
        "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "max_position_embeddings": 256, "tokenizer_vocab_size": 300},
        "synthetic": {"num_train": 64, "num_test": 8, "max_steps": 3},
        "dataset": {"path": "{run_dir}/data/train.jsonl", "id_field": "id",
                    "reward": "synthetic_arith", "max_prompt_tokens": 64,
                    "metadata_fields": {"answer": "answer", "solution": "solution"}},
        "eval": {"dataset": {"path": "{run_dir}/data/test.jsonl", "id_field": "id",
                             "reward": "synthetic_arith", "shuffle": False},
                 "max_new_tokens": 16},
        "sft": {"steps": 3, "batch_size": 8, "trainer": {"lr": 1e-3, "ppo_n_minibatches": 1}},
        "trainer": {"lr": 1e-4, "ppo_n_minibatches": 1, "micro_batch": {"token_budget": 1024},
                    "checkpoint_async": False},
        "sampling": {"group_size": 2, "max_new_tokens": 16},
        "schedule": {"batch_size": 2, "max_staleness": 1, "max_in_flight": 4,
                     "total_steps": total_steps},
        "rollout": {"server": {"engine": {"options": {"num_slots": 4, "max_seq_len": 128}},
                               "rewards": {"num_workers": 1}}},
        "checkpoint_every": 2,
    }


def write_experiment(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path
