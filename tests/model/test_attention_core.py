"""attention_core: every kernel it may pick computes the same masked attention (q/k and v head dims differ,
as in MLA), checked against an explicit float64 reference."""

import pytest
import torch

from dsv3.model import kernels
from dsv3.model.kernels import attention_core, attention_reference, causal_mask


def _reference(q, k, v, scale, keep):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("explicit_limit", [0, 1 << 30])  # 0: always SDPA; large: explicit where it applies
@pytest.mark.parametrize("start_pos", [0, 3])
def test_kernels_agree_with_the_reference(monkeypatch, dtype, explicit_limit, start_pos):
    monkeypatch.setattr(kernels, "EXPLICIT_SCORES_LIMIT", explicit_limit)
    g = torch.Generator().manual_seed(0)
    B, H, T, d_qk, d_v = 2, 3, 5, 12, 8
    S = start_pos + T
    q = torch.randn(B, H, T, d_qk, generator=g).to(dtype)
    k = torch.randn(B, H, S, d_qk, generator=g).to(dtype)
    v = torch.randn(B, H, S, d_v, generator=g).to(dtype)
    keep = causal_mask(T, S, start_pos, q.device).unsqueeze(1)
    mask = None if start_pos == 0 else keep
    out = attention_core(q, k, v, d_qk**-0.5, mask)
    assert out.shape == (B, H, T, d_v) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), _reference(q, k, v, d_qk**-0.5, keep), atol=tol, rtol=tol)


@pytest.mark.parametrize("start_pos", [0, 3])
def test_readable_reference_is_the_float64_formula(start_pos):
    """The reference path beside the kernel (what a reader checks the kernel against) is the formula."""
    g = torch.Generator().manual_seed(1)
    B, H, T, d_qk, d_v = 1, 2, 4, 8, 6
    S = start_pos + T
    q, k = torch.randn(B, H, T, d_qk, generator=g), torch.randn(B, H, S, d_qk, generator=g)
    v = torch.randn(B, H, S, d_v, generator=g)
    keep = causal_mask(T, S, start_pos, q.device).unsqueeze(1)
    mask = None if start_pos == 0 else keep
    want = _reference(q, k, v, d_qk**-0.5, keep)
    assert torch.allclose(attention_reference(q, k, v, d_qk**-0.5, mask).double(), want, atol=1e-5)
    assert torch.allclose(attention_core(q, k, v, d_qk**-0.5, mask).double(), want, atol=1e-5)
