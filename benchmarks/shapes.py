"""Qwen2.5-shaped model configs (random weights; the shapes decide the speed, nothing is
downloaded), shared by the benchmarks that run real-size models on an accelerator."""

QWEN25 = {"model_type": "qwen2", "vocab_size": 151936, "num_key_value_heads": 2,
          "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": True, "eos_token_id": None}  # fmt: skip
QWEN25_SHAPES = {
    "0.5B": {**QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14},
    "1.5B": {**QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12},
}  # fmt: skip
