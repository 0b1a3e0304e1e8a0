"""Test-wide settings: one torch thread (tiny models run faster without intra-op threading, and the
suite shares two cores), and the tiny training config several test folders use."""

import pytest
import torch

from dsv3.config import ModelConfig, preset

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_train_config() -> ModelConfig:
    """nano's structure at toy size (2 layers, 8 experts in 2 groups): a training step takes milliseconds."""
    return preset("nano").replace(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=128,
    )
