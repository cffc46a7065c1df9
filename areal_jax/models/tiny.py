"""Tiny model kit: a byte-level BPE tokenizer and a random model in HF format, no downloads.

Used by tests and the CPU quickstart. The tokenizer is trained locally with ``tokenizers``
(ByteLevel pre-tokenizer and decoder, NFC), saved through ``PreTrainedTokenizerFast`` so that
``AutoTokenizer.from_pretrained`` returns it unchanged, with a ChatML chat template.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from pathlib import Path

import jax.numpy as jnp

from areal_jax.config import ConfigError
from areal_jax.models.build import init_model
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_export import export_hf

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _default_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Short texts covering arithmetic chains, chat roles and common words."""
    rng = random.Random(seed)
    words = ("the answer is compute solve step first then so we get total sum difference "
             "product number question think check result final user assistant system "
             "please reason put your in boxed add subtract multiply divide equals").split()
    texts = []
    for _ in range(n):
        terms = [str(rng.randint(0, 99)) for _ in range(rng.randint(2, 6))]
        ops = [rng.choice("+-*") for _ in terms[1:]]
        expr = terms[0] + "".join(o + t for o, t in zip(ops, terms[1:]))
        texts.append(f"Compute {expr}. {terms[0]}{ops[0]}{terms[1]}={rng.randint(0, 200)}. "
                     f"Answer: {rng.randint(0, 200)} \\boxed{{{rng.randint(0, 99)}}}")
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + ".")
    return texts


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512, corpus=None):
    """Train and save a byte-level BPE tokenizer; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or _default_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


@dataclasses.dataclass
class TinyModelSpec:
    """Architecture of the tiny model; the vocabulary size comes from the tokenizer."""

    model_type: str = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    tokenizer_vocab_size: int = 512
    seed: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tiny.{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"tiny.hidden_size ({self.hidden_size}) must be num_heads "
                              f"({self.num_heads}) x an even head dimension (rotary embedding)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"tiny.num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        least = 256 + len(SPECIAL_TOKENS)  # every byte, and the special tokens
        if self.tokenizer_vocab_size < least:
            raise ConfigError(f"tiny.tokenizer_vocab_size: must be >= {least} (the 256 byte "
                              f"tokens and {len(SPECIAL_TOKENS)} special ones), got "
                              f"{self.tokenizer_vocab_size}")


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write tokenizer files, ``config.json`` and random weights for a tiny model to ``out_dir``."""
    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer = build_tiny_tokenizer(tok_dir, spec.tokenizer_vocab_size)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        cfg = ModelConfig.from_hf_dict({
            "model_type": spec.model_type,
            "vocab_size": len(tokenizer),
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.hidden_size // spec.num_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "eos_token_id": eos,
            "pad_token_id": pad,
        })
        model = init_model(cfg, seed=spec.seed, dtype=jnp.float32)
        export_hf(model, out_dir, tokenizer_dir=tok_dir)
    return out_dir

