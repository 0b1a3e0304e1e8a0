"""Next-token cross-entropy fused with the output head, one chunk of rows at a time.

The [tokens, vocab] logits are the largest activation of a training step (V3's vocabulary has 129,280
entries). The plain path builds them, then their log-softmax, then in backward a gradient of the same
size: three fresh full-size buffers and several passes over memory. Here each chunk of rows gets its
logits, its loss and its logit gradient in one buffer that is reused for the next chunk, and the
gradients of the hidden states and of the head weight are formed right away, so autograd only keeps
those two (the size of the input and of the weight) until backward. The matmuls are the same ones the
plain path runs; what goes away is the memory traffic and the allocations around them. The price: the
head-weight gradient ([V, D], fp32) exists from the forward pass on, once per loss term (MTP adds one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv3.model.autocast import compute_dtype

CHUNK_LOGITS = 1 << 24  # logits per chunk (64 MB in fp32): few chunks, so the head-weight gradient is summed rarely
MIN_CHUNK_ROWS = 64


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """mean over labelled positions of cross_entropy(h @ weight.T, labels), without materializing the
    logits. h [..., D], weight [V, D], labels [...] (``ignore_index`` marks positions without a label).

    Equals ``F.cross_entropy((h @ weight.T).float(), labels)``, also under autocast, where the head
    matmul runs in the autocast dtype and the softmax in fp32, as the plain path does."""
    h2, labels1 = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h2, weight, labels1, ignore_index)
    with torch.no_grad():
        return _chunked_loss(h2, weight, labels1, ignore_index, grads=None)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients; backward only scales them by the incoming grad."""

    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index):
        grad_h = torch.empty_like(h, dtype=compute_dtype(h))
        grad_w = torch.zeros_like(weight, dtype=_softmax_dtype(h))
        loss = _chunked_loss(h, weight, labels, ignore_index, grads=(grad_h, grad_w))
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h.to(h_dtype) * grad_loss.to(h_dtype), (grad_w * grad_loss).to(w_dtype), None, None)


def _softmax_dtype(h: torch.Tensor) -> torch.dtype:
    """The softmax's dtype: fp32, or wider when the matmul is (float64 inputs in tests)."""
    return torch.promote_types(compute_dtype(h), torch.float32)


def _chunked_loss(h, weight, labels, ignore_index, grads):
    """Sum of per-token losses / number of labelled tokens; with ``grads = (grad_h, grad_w)`` also
    writes d loss / d h [N, D] and d loss / d weight [V, D] (softmax dtype) into them."""
    dtype, wide = compute_dtype(h), _softmax_dtype(h)
    x, w = h.to(dtype), weight.to(dtype)
    valid = labels != ignore_index
    count = valid.sum()
    scale = valid.to(wide) / count.clamp(min=1)  # [N]: each labelled token's share of the mean
    targets = torch.where(valid, labels, 0)
    rows = min(x.shape[0], max(MIN_CHUNK_ROWS, CHUNK_LOGITS // w.shape[0]))
    logits = x.new_empty(rows, w.shape[0], dtype=wide)  # reused by every chunk
    low = x.new_empty(rows, w.shape[0]) if dtype != wide else logits  # the matmul's own dtype
    total = torch.zeros((), dtype=wide, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, x.shape[0], rows):
            part = slice(start, start + rows)
            r = x[part].shape[0]
            torch.mm(x[part], w.t(), out=low[:r])
            if low is not logits:
                logits[:r].copy_(low[:r])
            total += _softmax_in_place(logits[:r], targets[part], valid[part])
            if grads is None:
                continue
            grad_h, grad_w = grads
            d_logits = low[:r].copy_(logits[:r]) if low is not logits else logits[:r]  # softmax - onehot
            row_scale = scale[part, None].to(dtype)  # the mean's 1/count (0: unlabelled), on the small side
            torch.mm(d_logits, w, out=grad_h[part])
            grad_h[part] *= row_scale
            x_scaled = x[part] * row_scale
            if dtype == wide:
                grad_w.addmm_(d_logits.t(), x_scaled)
            else:
                grad_w += d_logits.t() @ x_scaled
    return total / count


def _softmax_in_place(logits: torch.Tensor, targets: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """Turns logits [r, V] into softmax - onehot(targets), in place, and returns the sum of the
    ``labelled`` rows' losses (logsumexp - target logit).

    One fused softmax does the work: at each row's largest logit the softmax equals 1 / sum exp(logit -
    top), which is at least 1/V (no underflow), so logsumexp = top - log(softmax there) comes out exact."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    best = logits.argmax(dim=-1)
    top, target_logit = logits[rows, best], logits[rows, targets]
    torch.softmax(logits, dim=-1, out=logits)  # row by row, each read before it is overwritten
    lse = top - logits[rows, best].log()
    logits[rows, targets] -= 1
    return (lse - target_logit)[labelled].sum()


def plain_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The unfused reference: ``F.cross_entropy`` on logits [..., V] in fp32 (or wider)."""
    wide = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide, labels.flatten(), ignore_index=ignore_index)
