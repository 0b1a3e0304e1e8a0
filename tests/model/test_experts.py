"""Grouped expert computation: exact against a per-token reference, the fused kernel against its readable
reference, correct gradients (float64 gradcheck, including experts that receive no token), and autocast
like nn.Linear."""

import torch
import torch.nn.functional as F

from dsv3.model.dispatch import local_rows
from dsv3.model.experts import GroupedExperts
from dsv3.model.kernels import routed_swiglu, routed_swiglu_reference


def _reference(experts: GroupedExperts, x, idx, weights):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[n, k]
            h = F.silu(x[n] @ experts.gate_proj[e].t()) * (x[n] @ experts.up_proj[e].t())
            out[n] += weights[n, k] * (h @ experts.down_proj[e].t())
    return out


def test_experts_equal_the_per_token_reference():
    torch.manual_seed(0)
    experts = GroupedExperts(6, 16, 8).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(20, 16, dtype=torch.float64)
    idx = torch.randint(0, 5, (20, 2))  # expert 5 gets no token
    idx[:, 1] = (idx[:, 0] + 1) % 5
    weights = torch.rand(20, 2, dtype=torch.float64)
    assert torch.allclose(experts(local_rows(x, idx, weights, 6)), _reference(experts, x, idx, weights))


def _routed_inputs(dtype, n=9, d=5, inter=3, experts=4, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, dtype=dtype, generator=g)
    idx = torch.stack([torch.randint(0, 2, (n,), generator=g) * 2, torch.full((n,), 2)], 1)[:, :k]
    idx[:, 1] = torch.where(idx[:, 0] == 2, 0, 2)  # experts 1 and 3 get no token
    weights = torch.rand(n, k, dtype=dtype, generator=g)
    shapes = [(experts, inter, d), (experts, inter, d), (experts, d, inter)]
    ws = [torch.randn(shape, dtype=dtype, generator=g) for shape in shapes]
    order = idx.flatten().argsort(stable=True)
    counts = torch.bincount(idx.flatten(), minlength=experts).tolist()
    return x, weights.flatten()[order], order // k, counts, ws


def test_routed_swiglu_gradients():
    """Every input's gradient (tokens, gate values, the three stacked weights) by float64 gradcheck,
    with two of four experts receiving no token (their weight gradients must be zero, not garbage)."""
    x, gates, token, counts, ws = _routed_inputs(torch.float64)
    inputs = [t.requires_grad_() for t in (x, gates, *ws)]
    assert torch.autograd.gradcheck(lambda a, b, c, d, e: routed_swiglu(a, b, token, counts, c, d, e), inputs)
    routed_swiglu(x, gates, token, counts, *ws).sum().backward()
    assert counts[1] == counts[3] == 0
    assert all(w.grad[[1, 3]].abs().max() == 0 for w in ws)


def test_routed_swiglu_equals_its_readable_reference():
    """The fused kernel (one autograd node, hand-written backward) against per-expert plain autograd:
    outputs and every gradient, float64."""
    x, gates, token, counts, ws = _routed_inputs(torch.float64, n=12, d=6, inter=4)
    results = []
    for fn in (routed_swiglu, routed_swiglu_reference):
        inputs = [t.clone().requires_grad_() for t in (x, gates, *ws)]
        y = fn(inputs[0], inputs[1], token, counts, *inputs[2:])
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        results.append([y, *(t.grad for t in inputs)])
    for fused, plain in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


def test_routed_swiglu_follows_autocast():
    x, gates, token, counts, ws = _routed_inputs(torch.float32, n=6, d=8, inter=4)
    ws = [w.requires_grad_() for w in ws]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = routed_swiglu(x, gates, token, counts, *ws)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(w.grad.dtype == torch.float32 for w in ws)
    b = [t.bfloat16() for t in (x, gates, *ws)]
    expected = torch.zeros_like(b[0])
    for i, t in enumerate(token.tolist()):
        e = int(torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[i])
        act = F.silu(b[0][t] @ b[2][e].t()) * (b[0][t] @ b[3][e].t()) * b[1][i]
        expected[t] += act @ b[4][e].t()
    assert torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_padding_expert_rows_changes_nothing(monkeypatch):
    """In bf16 on CPU each expert's rows are padded to a multiple of 32 (recurring matmul shapes); the
    padding rows carry gate 0, so outputs and every gradient equal the unpadded computation."""
    from dsv3.model import kernels

    x, gates, token, counts, ws = _routed_inputs(torch.float32, n=40, d=16, inter=8)
    results = []
    for multiple in (1, 32):
        monkeypatch.setattr(kernels, "CPU_LOW_PRECISION_ROW_MULTIPLE", multiple)
        inputs = [t.clone().requires_grad_() for t in (x, gates, *ws)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = routed_swiglu(inputs[0], inputs[1], token, counts, *inputs[2:])
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y.float(), *(t.grad for t in inputs)])
    for unpadded, padded in zip(*results, strict=True):
        assert torch.equal(unpadded, padded)
