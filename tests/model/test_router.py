"""DeepSeekMoE routing: the bias selects but never weighs; group limits hold; aux-free balancing works."""

import torch

from dsv3.config import ModelConfig
from dsv3.model.moe import MoE, Router

CFG = ModelConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  moe_intermediate_size=8, routed_scaling_factor=2.5).validate()


def _router(seed=0, **changes) -> Router:
    torch.manual_seed(seed)
    router = Router(CFG.replace(**changes))
    torch.nn.init.normal_(router.weight, std=0.3)
    return router


def test_bias_changes_selection_but_not_gate_values():
    router = _router()
    x = torch.randn(64, 32)
    idx0, w0, scores = router(x)
    router.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 16))
    idx1, w1, _ = router(x)
    assert not torch.equal(idx0, idx1)  # the bias moved the choice
    expected = scores.gather(1, idx1)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(w1, expected)  # gate values from unbiased scores of the chosen experts


def test_selected_experts_stay_inside_kept_groups():
    router = _router(1)
    router.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(256, 32)
    idx, _, scores = router(x)
    biased = (scores + router.e_score_correction_bias).view(256, 4, 4)
    group_score = biased.topk(2, dim=-1).values.sum(-1)
    kept = group_score.topk(2, dim=-1).indices  # [N, 2]
    groups_used = idx // 4
    assert ((groups_used[:, :, None] == kept[:, None, :]).any(-1)).all()
    assert max(g.unique().numel() for g in groups_used) <= 2


def test_softmax_group_max_and_greedy_methods():
    x = torch.randn(128, 32)
    greedy = _router(2, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False)
    idx, w, scores = greedy(x)
    top = scores.topk(4, dim=-1)
    assert torch.equal(idx.sort(-1).values, top.indices.sort(-1).values)
    assert torch.allclose(w.sort(-1).values, (top.values * 2.5).sort(-1).values)
    limited = _router(2, topk_method="group_limited_greedy", scoring_func="softmax")
    idx, _, scores = limited(x)
    kept = scores.view(128, 4, 4).amax(-1).topk(2, dim=-1).indices
    assert (((idx // 4)[:, :, None] == kept[:, None, :]).any(-1)).all()


def test_bias_update_lowers_imbalance_on_skewed_input():
    torch.manual_seed(3)
    moe = MoE(CFG.replace(n_group=1, topk_group=1))
    torch.nn.init.normal_(moe.gate.weight, std=0.3)
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.train()
    skew = torch.randn(32)  # a shared direction makes a few experts hot for most tokens
    x = torch.randn(8, 64, 32) + skew
    imbalance = []
    with torch.no_grad():
        for _ in range(150):
            moe(x)
            imbalance.append(moe.update_bias(speed=0.01)["max_over_mean"])
    assert imbalance[0] > 2.0
    assert max(imbalance[-10:]) < 0.5 * imbalance[0]


def test_sequence_balance_loss_matches_definition():
    torch.manual_seed(4)
    moe = MoE(CFG.replace(aux_loss_alpha=0.1)).train()
    torch.nn.init.normal_(moe.gate.weight, std=0.3)
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 10, 32)
    moe(x)
    idx, _, scores = moe.gate(x.view(-1, 32))
    idx, scores = idx.view(2, 10, 4), scores.view(2, 10, 16)
    loss = 0.0
    for b in range(2):
        f = torch.bincount(idx[b].flatten(), minlength=16).float() * 16 / (4 * 10)
        p = (scores[b] / scores[b].sum(-1, keepdim=True)).mean(0)
        loss += 0.1 * (f * p).sum() / 2
    assert torch.allclose(moe.aux_loss, loss)
