"""Architectures of well-known public models, for the active-versus-total comparison plot.

The shipped config.json files (DeepSeek, Qwen2.5-72B, Llama-3.1-405B) are read from disk; the others are
the fields of their public HF config.json that the analyzer needs. Their parameter counts are checked in
tests against the totals their authors publish (Mixtral 46.7B/12.9B, Qwen3-235B-A22B, Qwen3-30B-A3B).
"""

from __future__ import annotations

from dsv3.analysis.arch import Architecture, from_hf_dict, load_architecture

SHIPPED = ("deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "qwen2.5-72b", "llama-3.1-405b")

EXTRA_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 128256},
    "llama-3.1-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "vocab_size": 128256},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "vocab_size": 151936},
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "head_dim": 128, "moe_intermediate_size": 1536, "num_experts": 128,
                        "num_experts_per_tok": 8, "vocab_size": 151936},
}


def public_architectures() -> list[Architecture]:
    return [load_architecture(n) for n in SHIPPED] + [from_hf_dict(c, name=n) for n, c in EXTRA_CONFIGS.items()]
