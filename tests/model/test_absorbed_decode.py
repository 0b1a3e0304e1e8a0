"""The absorbed MLA path over the latent cache equals the expanded path (fp32, within 1e-5)."""

import torch

from dsv3.config import ModelConfig, RopeScaling
from dsv3.model import Transformer

CFG = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16),
                  max_position_embeddings=256).validate()


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def test_prefill_then_32_absorbed_steps_match_full_forward():
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    prefill = 16
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 64)
        chunks = [model(ids[:, :prefill], cache=cache)]
        for t in range(prefill, prefill + 32):
            chunks.append(model(ids[:, t : t + 1], cache=cache, start_pos=t))
    stepped = torch.cat(chunks, dim=1)
    assert (stepped - full).abs().max().item() < 1e-5


def test_absorbed_and_expanded_agree_on_the_same_cache():
    """Same cache contents, both attention paths, a multi-token chunk after a prefix."""
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outs = []
        for absorb in (False, True):
            cache = model.new_cache(1, 32)
            model(ids[:, :10], cache=cache)
            outs.append(model(ids[:, 10:], cache=cache, start_pos=10, absorb=absorb))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_cache_holds_only_the_latent():
    model = _model()
    cache = model.new_cache(1, 100, dtype=torch.bfloat16)
    per_token_layer = CFG.kv_lora_rank + CFG.qk_rope_head_dim
    assert cache.bytes_per_token_per_layer() == per_token_layer * 2
    layers = CFG.num_hidden_layers + CFG.num_nextn_predict_layers
    assert cache.nbytes == layers * 100 * per_token_layer * 2
