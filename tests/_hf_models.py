"""Tiny Hugging Face reference models with every tensor randomised (so no bug hides in a
zero bias or a unit norm), saved to a directory for loading through our HF I/O."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)


def hf_model(model_type: str, tie: bool = False, seed: int = 0, **overrides):
    """A random transformers model (fp32, eval mode) of the given family."""
    kw = {**COMMON, "tie_word_embeddings": tie, **overrides}
    if model_type == "qwen2":
        cfg, cls = Qwen2Config(rope_theta=10000.0, **kw), Qwen2ForCausalLM
    elif model_type == "qwen3":
        cfg, cls = Qwen3Config(head_dim=16, rope_theta=1000000.0, **kw), Qwen3ForCausalLM
    elif model_type == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        cfg, cls = LlamaConfig(rope_parameters=rope, **kw), LlamaForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise + 1.0 if name.endswith("norm.weight") else noise)
    return model


def save_hf_model(model, path, dtype=torch.float32):
    model.to(dtype).save_pretrained(path)
    model.to(torch.float32)
    return path


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens after ``prompt`` (ids)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def edit_weights(path, edit) -> None:
    """Rewrite ``path``/model.safetensors with ``edit(tensors)`` applied to a {name: array} copy."""
    from areal_jax.models.safetensors_io import SafetensorsFile, save_safetensors

    file = Path(path) / "model.safetensors"
    src = SafetensorsFile(file)
    tensors = {name: np.array(src.get(name)) for name in src.keys()}
    del src
    edit(tensors)
    save_safetensors(file, tensors)
