"""Parity with transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, in both directions:
a checkpoint saved by dsv3 loads in transformers with the same logits, and one saved by transformers
loads in dsv3 with the same logits (fp32, within 1e-4)."""

import pytest
import torch

from dsv3.checkpoint import load_pretrained
from dsv3.config import ModelConfig
from dsv3.model import Transformer

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=1,
            max_position_embeddings=256, torch_dtype="float32")

CASES = {
    # q_lora_rank null, one group, YaRN with the test sequence beyond the original length
    "v3-no-qlora-yarn": dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                             rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
                                               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # group-limited routing, norm_topk_prob false, low-rank query
    "v3-groups-nonorm": dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=False,
                             routed_scaling_factor=1.5, rope_scaling=None),
    # DeepSeek-V2: softmax scores, group max, YaRN with mscale 0.707
    "v2-softmax-groups": dict(model_type="deepseek_v2", q_lora_rank=24, scoring_func="softmax",
                              topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              norm_topk_prob=False, routed_scaling_factor=16.0, num_nextn_predict_layers=0,
                              rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=16,
                                                beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
    "v2-lite-greedy": dict(model_type="deepseek_v2", q_lora_rank=None, scoring_func="softmax",
                           topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                           routed_scaling_factor=1.0, num_nextn_predict_layers=0, rope_scaling=None),
}


def _config(name: str) -> ModelConfig:
    return ModelConfig(**{**BASE, **CASES[name]}).validate()


def _hf_class(cfg: ModelConfig):
    return transformers.DeepseekV2ForCausalLM if cfg.model_type == "deepseek_v2" else transformers.DeepseekV3ForCausalLM


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, including norms and a non-zero correction bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or not t.is_floating_point():
                continue
            if "norm" in name:
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.08 * torch.randn(t.shape, generator=gen))


def _ids(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CASES))
def test_dsv3_checkpoint_loads_in_transformers(name, tmp_path):
    cfg = _config(name)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    _randomize(ours, 1)
    ours.save_pretrained(tmp_path)
    hf = _hf_class(cfg).from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = _ids(cfg)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_checkpoint_loads_in_dsv3(name, tmp_path):
    cfg = _config(name)
    hf_config = _hf_class(cfg).config_class.from_dict(cfg.to_dict(rope_layout="new"))
    torch.manual_seed(0)
    hf = _hf_class(cfg)(hf_config).eval()
    _randomize(hf, 2)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    ids = _ids(cfg, 1)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    # transformers does not save the MTP layer; the main model still loads and matches
    assert ours.config.num_nextn_predict_layers == 0


@pytest.mark.parametrize("layers", [3, 61])
def test_convert_says_why_transformers_reports_the_mtp_layer(layers, tmp_path, capsys):
    """docs/model.md: transformers lists the MTP layer (model.layers.{num_hidden_layers}.*) as UNEXPECTED and
    misses nothing, except at V3's own depth of 61, whose MTP keys it skips silently; `dsv3 convert` says so
    in one stderr line exactly when transformers will list them."""
    from dsv3.cli import main

    cfg = ModelConfig(**{**BASE, **CASES["v3-groups-nonorm"], "num_hidden_layers": layers}).validate()
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    notes = capsys.readouterr().err.splitlines()
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                 output_loading_info=True)
    prefix = f"model.layers.{layers}."
    assert any(k.startswith(prefix) for k in load_pretrained(tmp_path / "hf").state_dict())  # the MTP layer
    assert not info["missing_keys"]
    if layers == 61:
        assert notes == [] and not info["unexpected_keys"]
    else:  # one line per tensor (transformers' names: the experts' gate and up merged), all the MTP layer's
        assert info["unexpected_keys"] and all(k.startswith(prefix) for k in info["unexpected_keys"])
        assert notes == [f"note: model.layers.{layers}.* is the MTP layer, kept on purpose as DeepSeek's checkpoints "
                         "keep theirs; transformers loads the main model and lists those keys as UNEXPECTED (see "
                         "docs/model.md)"]
