"""Parameter counts of the shipped configs, the public models, and the meta-device cross-check."""

import dataclasses

import pytest

from dsv3.analysis.arch import from_hf_dict, load_architecture
from dsv3.analysis.params import count_params
from dsv3.analysis.public_models import EXTRA_CONFIGS


def counts(name):
    return count_params(load_architecture(name))


def test_deepseek_v3_is_671b_without_mtp_and_37_5b_activated():
    c = counts("deepseek-v3")
    assert c.total_params == 671_026_419_200  # 671B: the paper's and README's figure
    assert c.active_params == 37_552_297_472  # incl. 0.93B embedding and 0.93B head
    assert c.matmul_active == 36_624_596_992  # the N of Table 2's 6N (docs/references.md#flops-per-token: 36.62B)
    assert c.total["embedding"] == c.total["output_head"] == 129280 * 7168
    assert c.active["routed_experts"] == 58 * 8 * 3 * 7168 * 2048
    assert c.total["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    assert c.total["router"] == 58 * (256 * 7168 + 256)  # weight + e_score_correction_bias
    assert c.mtp_total == pytest.approx(11.61e9, rel=1e-3)  # README: "11.5B unique"


@pytest.mark.parametrize("name, total_b, active_b", [
    ("deepseek-v2", 235.74, 21.38), ("deepseek-v2-lite", 15.71, 2.66),
    ("qwen2.5-72b", 72.71, 72.71), ("llama-3.1-405b", 405.85, 405.85),
])
def test_shipped_configs(name, total_b, active_b):
    c = counts(name)
    assert c.total_params / 1e9 == pytest.approx(total_b, abs=0.005)
    assert c.active_params / 1e9 == pytest.approx(active_b, abs=0.005)


def test_deepseek_v2_has_no_mtp_and_v2_matmul_matches_table2_reconstruction():
    c = counts("deepseek-v2")
    assert c.mtp_total == 0
    assert c.matmul_active / 1e9 == pytest.approx(20.85, abs=0.005)


@pytest.mark.parametrize("name, total_b, active_b", [
    ("mixtral-8x7b", 46.70, 12.88), ("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19),
    ("llama-3.1-8b", 8.03, 8.03), ("llama-3.1-70b", 70.55, 70.55),
])
def test_public_models_match_their_published_sizes(name, total_b, active_b):
    c = count_params(from_hf_dict(EXTRA_CONFIGS[name], name=name))
    assert c.total_params / 1e9 == pytest.approx(total_b, abs=0.01)
    assert c.active_params / 1e9 == pytest.approx(active_b, abs=0.01)


@pytest.mark.parametrize("name", ["nano", "small"])
def test_trainable_presets_match_a_hand_formula(name):
    """Presets may be retuned, so the expected count is recomputed from the config's own fields."""
    from dsv3.config import preset

    cfg = preset(name)
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = d * h * cfg.qk_head_dim if cfg.q_lora_rank is None else (
        d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim)
    attn = (q + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
            + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
    moe = (cfg.n_routed_experts + cfg.n_shared_experts) * 3 * d * cfg.moe_intermediate_size
    moe += cfg.n_routed_experts * d + (cfg.n_routed_experts if cfg.topk_method == "noaux_tc" else 0)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    expected = (2 * cfg.vocab_size * d + cfg.num_hidden_layers * (attn + 2 * d) + d
                + n_dense * 3 * d * cfg.intermediate_size + n_moe * moe)
    c = counts(name)
    assert c.total_params == expected
    assert c.active_params < c.total_params


def test_tied_head_is_counted_once_but_still_multiplies():
    cfg = dict(EXTRA_CONFIGS["llama-3.1-8b"], tie_word_embeddings=True)
    tied, untied = count_params(from_hf_dict(cfg)), count_params(from_hf_dict(EXTRA_CONFIGS["llama-3.1-8b"]))
    assert untied.total_params - tied.total_params == 128256 * 4096
    assert tied.total["output_head"] == 0
    assert tied.matmul_active == untied.matmul_active


def test_qwen2_qkv_bias_and_qwen3_qk_norm_are_counted():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100}
    llama = count_params(from_hf_dict({**base, "model_type": "llama"})).total["attention"]
    qwen2 = count_params(from_hf_dict({**base, "model_type": "qwen2"})).total["attention"]
    qwen3 = count_params(from_hf_dict({**base, "model_type": "qwen3"})).total["attention"]
    assert qwen2 - llama == 2 * (64 + 2 * 32)  # q, k, v biases per layer
    assert qwen3 - llama == 2 * (2 * 16)  # q_norm and k_norm of head_dim per layer


def test_qwen3_moe_dense_layers_and_sparse_step():
    cfg = dict(EXTRA_CONFIGS["qwen3-30b-a3b"], mlp_only_layers=[0, 1], decoder_sparse_step=2)
    arch = from_hf_dict(cfg)
    assert arch.moe_layers == tuple(i for i in range(2, 48) if (i + 1) % 2 == 0)
    c = count_params(arch)
    assert c.total["dense_ffn"] == (48 - len(arch.moe_layers)) * 3 * 2048 * 6144


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "nano", "small"])
def test_analytic_count_equals_the_model_built_on_meta(name):
    from dsv3.analysis.meta_check import cross_check
    from dsv3.config import preset

    pairs = cross_check(preset(name))
    assert {c: a for c, (a, _) in pairs.items()} == {c: m for c, (_, m) in pairs.items()}
    assert sum(a for a, _ in pairs.values()) > 0


def test_meta_categories_from_names():
    from dsv3.analysis.meta_check import category_of

    assert category_of("model.layers.3.mlp.experts.gate_proj", 61) == "routed_experts"
    assert category_of("model.layers.0.mlp.gate_proj.weight", 61) == "dense_ffn"
    assert category_of("model.layers.5.mlp.gate.weight", 61) == "router"
    assert category_of("model.layers.61.eh_proj.weight", 61) == "mtp"
    assert category_of("model.layers.2.self_attn.kv_a_layernorm.weight", 61) == "attention"


def test_mtp_of_a_dense_layer_config():
    arch = load_architecture("deepseek-v3")
    dense_mtp = dataclasses.replace(arch, mtp_is_moe=False)
    assert count_params(dense_mtp).mtp_total < count_params(arch).mtp_total
