"""``areal-jax tiny-model OUT_DIR``: build a tiny tokenizer + random model in HF format."""

from __future__ import annotations

import argparse
import dataclasses
import re

NAME = "tiny-model"
HELP = "Build a tiny byte-level BPE tokenizer and a random model (HF format), no downloads."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from areal_jax.models.tiny import TinyModelSpec

    parser.add_argument("out_dir", help="directory to write: new, empty, or an earlier tiny model (replaced)")
    for field in dataclasses.fields(TinyModelSpec):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "str": str}.get(field.type, type(field.default))
            parser.add_argument(flag, type=kind, default=field.default)
    parser.add_argument("--prompt", default="Compute 3+4-2.",
                        help="user message whose next-token prediction is printed")


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import numpy as np
    from transformers import AutoTokenizer

    from areal_jax.config import ConfigError
    from areal_jax.models import build_tiny_model, load_hf_model
    from areal_jax.models.tiny import TinyModelSpec

    try:
        spec = TinyModelSpec(**{f.name: getattr(args, f.name)
                                for f in dataclasses.fields(TinyModelSpec)})
    except ConfigError as e:  # named by this command's flags, not the config's keys
        raise ConfigError(re.sub(r"\btiny\.(\w+)", lambda m: "--" + m[1].replace("_", "-"),
                                 str(e))) from None
    path = build_tiny_model(args.out_dir, spec)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model, _ = load_hf_model(path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    tokens = jnp.asarray([ids])
    logits = np.asarray(model.forward_logits(tokens, jnp.ones_like(tokens),
                                             jnp.arange(len(ids))[None]))[0, -1]
    top = np.argsort(-logits)[:5]
    print(f"wrote {path}: {spec.model_type}, {model.cfg.num_params():,} parameters, "
          f"vocab {model.cfg.vocab_size}, {spec.num_layers} layers")
    print(f"prompt ({len(ids)} tokens): {tokenizer.decode(ids)!r}")
    print("next-token logits (top 5, random weights):")
    for t in top:
        print(f"  {tokenizer.decode([int(t)])!r:>14}  {logits[t]:+.4f}")
    return 0
