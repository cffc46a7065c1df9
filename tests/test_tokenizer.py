"""A model directory's tokenizer is checked against its model before anything uses it: one
without its vocabulary (transformers then builds a few special tokens from
``tokenizer_config.json`` and encodes every prompt to nothing) or one of a larger vocabulary
(ids past the embedding: clamped lookups, NaN log-probs) is refused, naming the directory."""

import asyncio
import shutil

import pytest
from _rollout_fakes import VOCAB, ArithmeticEngine, ExactAnswerScorer
from _rollout_harness import server_config

from areal_jax.config import ConfigError
from areal_jax.controller.prepare import check_model_dir
from areal_jax.models import ModelConfigError, TinyModelSpec, build_tiny_model
from areal_jax.models.tokenizer import check_tokenizer, load_tokenizer
from rollout.server import start_server

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=128, tokenizer_vocab_size=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "model", SPEC)


def test_a_model_directory_without_its_vocabulary_is_refused(model_dir, tmp_path):
    # The auditor's run: tokenizer.json removed, tokenizer_config.json kept; every prompt
    # became [2, 1, 2], and SFT, RL and the evaluations ran to the end at accuracy 0.
    bare = shutil.copytree(model_dir, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    assert (bare / "tokenizer_config.json").is_file()
    with pytest.raises(ConfigError, match=r"model_path: .*bare has no tokenizer vocabulary"):
        check_model_dir(bare, "model_path")
    with pytest.raises(ModelConfigError, match="has no tokenizer vocabulary"):
        load_tokenizer(bare, 300)
    assert len(load_tokenizer(model_dir, 300)) <= 300  # the whole directory is accepted


def test_another_models_larger_tokenizer_is_refused(model_dir):
    with pytest.raises(ModelConfigError, match=r"model_path: the tokenizer has \d+ tokens, more "
                                               r"than the model's vocab_size 200"):
        load_tokenizer(model_dir, 200, "model_path")


def test_a_malformed_tokenizer_file_is_refused_naming_the_setting(model_dir, tmp_path):
    # Nested too deep, its parse raised RecursionError: a raw traceback at the server's start.
    bad = shutil.copytree(model_dir, tmp_path / "deep")
    (bad / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelConfigError, match=r"engine.model_path: cannot load a tokenizer "):
        load_tokenizer(bad, 300, "engine.model_path")


def test_a_tokenizer_that_encodes_text_to_nothing_is_refused():
    class Hollow:  # what transformers builds from tokenizer_config.json alone
        def __len__(self):
            return 3

        def encode(self, text, add_special_tokens=False):
            return []

    with pytest.raises(ModelConfigError, match="encodes text to no tokens"):
        check_tokenizer(Hollow(), 300, "model_path")


def test_a_server_refuses_a_tokenizer_larger_than_its_models_vocabulary(model_dir, tmp_path):
    engine = ArithmeticEngine()  # serves len(VOCAB) token ids
    config = server_config(tmp_path, model_dir)

    async def main():
        await start_server(config, engine=engine, scorer=ExactAnswerScorer(),
                           reward_names=ExactAnswerScorer().names)

    with pytest.raises(ConfigError, match=rf"engine.tokenizer_path: the tokenizer has \d+ "
                                          rf"tokens, more than the model's vocab_size {len(VOCAB)}"):
        asyncio.run(main())
    assert engine.closed  # stopped again


def test_a_tokenizer_naming_custom_code_is_refused_without_running_it(model_dir, tmp_path,
                                                                      monkeypatch):
    # A tokenizer directory without a config.json (engine.tokenizer_path may name one) whose
    # tokenizer_config.json names its own class through auto_map: transformers asked on stdin
    # whether to run the directory's code, and imported it on "y".
    import io
    import json

    evil = shutil.copytree(model_dir, tmp_path / "evil")
    (evil / "config.json").unlink()
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", None]},
                  tokenizer_class="EvilTokenizer")
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (evil / "evil_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    with pytest.raises(ModelConfigError, match="tokenizer_path: cannot load a tokenizer .*custom"):
        load_tokenizer(evil, 300, "tokenizer_path")
    assert not marker.exists()
