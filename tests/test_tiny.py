"""The tiny model kit: tokenizer survives AutoTokenizer, model loads in transformers."""

import re

import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_jax.cli import main
from areal_jax.models import TinyModelSpec, build_tiny_model, load_hf_model


def test_tiny_model_roundtrips_through_transformers(tmp_path):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, tokenizer_vocab_size=320)
    path = build_tiny_model(tmp_path / "tiny", spec)
    tok = AutoTokenizer.from_pretrained(path)
    text = "Compute 12+7-3. 12+7=19. 19-3=16. Answer: 16"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learned
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    ours, _ = load_hf_model(path)
    assert ours.cfg.vocab_size == len(tok)
    assert ours.cfg.eos_token_ids == (tok.eos_token_id,)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = np.asarray([ids])
    with torch.no_grad():
        expected = ref(torch.tensor(x)).logits.numpy()
    got = np.asarray(ours.forward_logits(jnp.asarray(x), jnp.ones_like(jnp.asarray(x)),
                                         jnp.arange(x.shape[1])[None]))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_tiny_model_cli(tmp_path, capsys):
    rc = main(["tiny-model", str(tmp_path / "m"), "--hidden-size", "32", "--intermediate-size",
               "64", "--num-layers", "2", "--tokenizer-vocab-size", "300"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "parameters" in out and "next-token logits" in out
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_the_tiny_model_command_refuses_shapes_it_cannot_build(tmp_path, capsys):
    # These gave a ZeroDivisionError, or wrote (replacing OUT_DIR) a model transformers refuses.
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    for args, message in ((["--num-heads", "0"], "--num-heads: must be >= 1, got 0"),
                          (["--hidden-size", "28"], r"--hidden-size \(28\) must be num_heads "
                                                    r"\(4\) x an even head dimension"),
                          (["--num-kv-heads", "3"], r"--num-heads \(4\) must be a multiple"),
                          (["--tokenizer-vocab-size", "100"],  # it made one of 259, unsaid
                           r"--tokenizer-vocab-size: must be >= 259 \(the 256 byte tokens")):
        assert main(["tiny-model", str(out), *args]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, err
    assert (out / "mine.txt").read_text() == "kept"
