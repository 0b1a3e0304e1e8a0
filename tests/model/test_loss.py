"""The fused head + cross-entropy equals F.cross_entropy on the materialized logits: value and both
gradients, in float64 by gradcheck, with ignored labels, across chunk boundaries and under autocast."""

import pytest
import torch

from dsv3.model import kernels as loss_module
from dsv3.model.kernels import linear_cross_entropy, plain_cross_entropy


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 7 * 11)  # 7 rows of 11 logits: ragged last chunk
    monkeypatch.setattr(loss_module, "MIN_CHUNK_ROWS", 1)


def _inputs(dtype, n=(3, 10), d=6, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n, d, dtype=dtype, generator=g)
    w = torch.randn(v, d, dtype=dtype, generator=g)
    labels = torch.randint(0, v, n, generator=g)
    labels[0, :4] = -100
    labels[-1, -1] = -100
    return h, w, labels


def test_matches_plain_cross_entropy_with_gradients(small_chunks):
    h, w, labels = _inputs(torch.float64)
    h.requires_grad_(), w.requires_grad_()
    fused = linear_cross_entropy(h, w, labels)
    (fused * 3.0).backward()  # a non-unit incoming gradient
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    plain = plain_cross_entropy(h @ w.t(), labels)
    (plain * 3.0).backward()
    assert torch.allclose(fused, plain, rtol=1e-12, atol=0)
    assert torch.allclose(grads[0], h.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grads[1], w.grad, rtol=1e-10, atol=1e-12)


def test_gradcheck(small_chunks):
    h, w, labels = _inputs(torch.float64, n=(2, 5), d=4, v=9)
    h.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, labels), (h, w))


def test_without_grad_only_the_loss(small_chunks):
    h, w, labels = _inputs(torch.float32)
    with torch.no_grad():
        fused = linear_cross_entropy(h, w, labels)
    assert torch.allclose(fused, plain_cross_entropy(h @ w.t(), labels), rtol=1e-6)


def test_autocast_matches_the_plain_path(small_chunks):
    h, w, labels = _inputs(torch.float32, d=32, v=50)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(h, w, labels)
        plain = plain_cross_entropy(torch.nn.functional.linear(h, w), labels)
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, plain, rtol=1e-5)
    fused.backward()
    fused_grad, w.grad = w.grad.clone(), None
    plain.backward()
    assert fused_grad.dtype == torch.float32
    assert torch.allclose(fused_grad, w.grad, rtol=2e-2, atol=2e-3)


def test_all_labels_ignored_gives_zero_loss_and_gradients():
    """A chat window may hold no assistant token: its loss is 0 with no gradient (torch's mean is 0/0 = NaN,
    which would skip the whole step as non-finite)."""
    h, w, labels = _inputs(torch.float32)
    labels.fill_(-100)
    h.requires_grad_(True)
    for loss in (linear_cross_entropy(h, w, labels), plain_cross_entropy(h @ w.t(), labels)):
        assert float(loss.detach()) == 0.0
        (grad,) = torch.autograd.grad(loss, h)
        assert not grad.any()
