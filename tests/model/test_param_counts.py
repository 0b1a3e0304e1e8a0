"""The deepseek-v3 preset on the meta device counts as DeepSeek says.

Convention: the input embedding and the output head are counted in both the total and the activated
count; a token activates the attention, dense FFNs, shared experts, router and num_experts_per_tok of
the routed experts in each MoE layer. MTP modules are counted apart (their embedding and head are the
main model's, but DeepSeek's checkpoint stores copies of both, which is how it reaches 685B).
"""

import torch

from dsv3.config import preset
from dsv3.model import Transformer


def _counts(name: str):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    main, mtp, routed = 0, 0, 0
    for pname, p in model.named_parameters():
        layer = pname.split(".")[2] if pname.startswith("model.layers.") else None
        if layer is not None and int(layer) >= cfg.num_hidden_layers:
            mtp += p.numel()
        else:
            main += p.numel()
            routed += p.numel() if ".mlp.experts." in pname else 0
    active = main - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    return cfg, main, active, mtp


def test_deepseek_v3_is_671b_total_37b_active_plus_mtp():
    cfg, main, active, mtp = _counts("deepseek-v3")
    assert round(main / 1e9) == 671
    assert 36.5e9 < active < 38e9  # DeepSeek: "37B" (README: 36.7B; we count 37.5B with both embeddings)
    embed_and_head = 2 * cfg.vocab_size * cfg.hidden_size
    assert 11.4e9 < mtp < 11.8e9  # README_WEIGHTS: "11.5B unique"
    assert 13e9 < mtp + embed_and_head < 14.5e9  # "about 14B" with the stored copies
    assert 684e9 < main + mtp + embed_and_head < 686e9  # the released checkpoint's "685B"


def test_deepseek_v2_is_236b_total_21b_active():
    _, main, active, _ = _counts("deepseek-v2")
    assert round(main / 1e9) == 236
    assert 20.5e9 < active < 22e9


def test_small_preset_is_about_100m():
    _, main, _, mtp = _counts("small")
    assert 80e6 < main + mtp < 120e6
