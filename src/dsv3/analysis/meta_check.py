"""Cross-check the analytic parameter count against the real model built on the meta device.

`dsv3.model.Transformer` uses the HF checkpoint names, so each tensor's category follows from its name.
On the meta device a 671B model costs no memory, so this runs in seconds on a laptop.
"""

from __future__ import annotations

import dataclasses

from dsv3.analysis.arch import from_model_config
from dsv3.analysis.params import CATEGORIES, count_params
from dsv3.config import ModelConfig


def category_of(name: str, num_hidden_layers: int) -> str:
    """The analyzer's category for one checkpoint tensor name."""
    if name.startswith("lm_head."):
        return "output_head"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name == "model.norm.weight":
        return "norms"
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"unexpected parameter name {name!r}")
    if int(parts[2]) >= num_hidden_layers:
        return "mtp"
    rest = ".".join(parts[3:])
    if rest.startswith("self_attn."):
        return "attention"
    if rest.startswith(("input_layernorm.", "post_attention_layernorm.")):
        return "norms"
    if rest.startswith("mlp.experts."):
        return "routed_experts"
    if rest.startswith("mlp.shared_experts."):
        return "shared_experts"
    if rest.startswith("mlp.gate."):
        return "router"
    if rest.startswith("mlp."):
        return "dense_ffn"
    raise ValueError(f"unexpected parameter name {name!r}")


def meta_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters (and the persistent router bias) of `Transformer(cfg)` on the meta device, by category."""
    import torch

    from dsv3.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    counts = dict.fromkeys((*CATEGORIES, "mtp"), 0)
    for name, tensor in tensors.items():
        counts[category_of(name, cfg.num_hidden_layers)] += tensor.numel()
    return counts


def analytic_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """The analyzer's totals by category for the same config, with as many MTP modules as the model builds."""
    arch = dataclasses.replace(from_model_config(cfg), mtp_layers=cfg.num_nextn_predict_layers)
    counts = count_params(arch)
    return {**counts.total, "mtp": counts.mtp_total}


def cross_check(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """category -> (analytic, meta model); equal pairs mean the two counts agree."""
    analytic, meta = analytic_param_counts(cfg), meta_param_counts(cfg)
    return {c: (analytic[c], meta[c]) for c in analytic}
