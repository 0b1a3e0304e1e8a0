"""Grouped expert computation: exact against a per-token reference, correct gradients (float64
gradcheck, including experts that receive no token), and autocast like nn.Linear."""

import torch
import torch.nn.functional as F

from dsv3.model.moe import Experts, grouped_linear


def _reference(experts: Experts, x, idx, weights):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[n, k]
            h = F.silu(x[n] @ experts.gate_proj[e].t()) * (x[n] @ experts.up_proj[e].t())
            out[n] += weights[n, k] * (h @ experts.down_proj[e].t())
    return out


def test_experts_equal_the_per_token_reference():
    torch.manual_seed(0)
    experts = Experts(6, 16, 8).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(20, 16, dtype=torch.float64)
    idx = torch.randint(0, 5, (20, 2))  # expert 5 gets no token
    idx[:, 1] = (idx[:, 0] + 1) % 5
    weights = torch.rand(20, 2, dtype=torch.float64)
    assert torch.allclose(experts(x, idx, weights), _reference(experts, x, idx, weights))


def test_grouped_linear_gradients():
    torch.manual_seed(1)
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_linear(a, b, [4, 0, 5, 0]), (x, w))


def test_grouped_linear_follows_autocast():
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_linear(x, w, [3, 3])
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32
    expected = torch.cat([x[:3].bfloat16() @ w[0].bfloat16().t(), x[3:].bfloat16() @ w[1].bfloat16().t()])
    assert torch.equal(y, expected)
