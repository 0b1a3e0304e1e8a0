"""The model's fused kernels, kept apart from the concept code that calls them, each beside the short
readable reference it must agree with (the tests compare every kernel with its reference):

* ``routed_swiglu``: the routed experts of one MoE layer in one autograd node; reference
  ``routed_swiglu_reference`` (per-expert plain autograd).
* ``linear_cross_entropy``: the next-token loss fused with the output head, chunk by chunk; reference
  ``plain_cross_entropy`` (materialized logits).
* ``attention_core``: explicit scores on a CPU for short sequences, else SDPA; reference
  ``attention_reference`` (masked softmax written out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv3.model.autocast import compute_dtype

# ==== routed experts ================================================================================


class _RoutedSwiGLU(torch.autograd.Function):
    """The routed experts of one MoE layer in one autograd node: for every expert e and its rows,
    out[token] += gate * down_e(silu(gate_e(x[token])) * up_e(x[token])).

    ``token [S]`` lists rows of ``x [N, D]`` sorted by expert (``counts[e]`` rows each) and ``gates [S]``
    their gate values. Each expert's slice runs as a few small matmuls whose temporaries stay in cache;
    nothing of size [S, D] is ever built, the gate values scale the [S, I] activation rather than the
    [S, D] output, and the backward writes each expert's weight gradient straight into one [E, ...]
    buffer. Only the two [S, I] projections are saved for backward (plain autograd keeps the gathered
    [S, D] input and five [S, I] tensors). Under autocast everything runs in the autocast dtype, as
    ``nn.Linear`` would; gradients come back in each input's own dtype."""

    @staticmethod
    def forward(ctx, x, gates, token, counts, w_gate, w_up, w_down):
        ctx.dtypes = (x.dtype, gates.dtype, w_gate.dtype)
        dtype = compute_dtype(x)
        x, gates, w_gate, w_up, w_down = (t.to(dtype) for t in (x, gates, w_gate, w_up, w_down))
        g = x.new_empty(token.numel(), w_gate.shape[1])  # [S, I] gate projection, kept for backward
        u = torch.empty_like(g)  # [S, I] up projection, kept for backward
        with torch.autocast(x.device.type, enabled=False):
            out = routed_forward(x, gates, token, counts, lambda e: (w_gate[e], w_up[e], w_down[e]), g, u)
        ctx.save_for_backward(x, gates, token, g, u, w_gate, w_up, w_down)
        ctx.counts = counts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gates, token, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gates = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w = ctx.needs_input_grad[4:7]
        grad_out = grad_out.to(x.dtype)
        grad_x = torch.zeros_like(x) if need_x else None
        grad_gates = torch.empty_like(gates) if need_gates else None
        grad_w = [_expert_grad_buffer(w, ctx.counts) if need else None
                  for w, need in zip((w_gate, w_up, w_down), need_w, strict=True)]
        with torch.autocast(x.device.type, enabled=False):
            for e, rows in expert_slices(ctx.counts):
                tok = token[rows]
                go, ge, ue, gate = grad_out[tok], g[rows], u[rows], gates[rows, None]  # [n, D], [n, I] x2, [n, 1]
                sig = torch.sigmoid(ge)
                act = ge * sig * ue  # silu(g) * u
                if grad_w[2] is not None:
                    torch.mm(go.t(), act * gate, out=grad_w[2][e])
                d_act = go @ w_down[e]  # [n, I]
                if grad_gates is not None:
                    grad_gates[rows] = (d_act * act).sum(-1)
                d_act.mul_(gate)
                d_up = d_act * ge * sig
                d_gate = d_act.mul_(ue).mul_(sig).mul_(1 + ge * (1 - sig))  # silu'(g) = sig * (1 + g (1 - sig))
                xe = x[tok]
                if grad_w[0] is not None:
                    torch.mm(d_gate.t(), xe, out=grad_w[0][e])
                if grad_w[1] is not None:
                    torch.mm(d_up.t(), xe, out=grad_w[1][e])
                if grad_x is not None:
                    grad_x.index_add_(0, tok, torch.addmm(d_gate @ w_gate[e], d_up, w_up[e]))
        x_dtype, gates_dtype, w_dtype = ctx.dtypes
        grads_w = [None if gw is None else gw.to(w_dtype) for gw in grad_w]
        return (None if grad_x is None else grad_x.to(x_dtype),
                None if grad_gates is None else grad_gates.to(gates_dtype), None, None, *grads_w)


def routed_forward(x, gates, token, counts, expert_weights, g=None, u=None, inputs=None) -> torch.Tensor:
    """The routed experts' forward, one expert's slice at a time: out[token] += gate * SwiGLU_e(x[token]).

    ``expert_weights(e)`` gives expert e's (gate [I, D], up [I, D], down [D, I]) weights, so lazily
    dequantized inference weights run the very same arithmetic as training's. ``g``/``u`` [S, I], when
    given, receive the gate and up projections (what the backward needs). ``inputs``, when given, maps
    each projection's input (x, and the gated SwiGLU before down) to what the weights multiply: integer
    weights round activations."""
    out = torch.zeros_like(x)
    if inputs is not None:
        x = inputs(x)
    for e, rows in expert_slices(counts):
        tok = token[rows]
        xe = x[tok]
        w_gate, w_up, w_down = expert_weights(e)
        ge = torch.mm(xe, w_gate.t(), out=None if g is None else g[rows])
        ue = torch.mm(xe, w_up.t(), out=None if u is None else u[rows])
        act = F.silu(ge).mul_(ue).mul_(gates[rows, None])
        out.index_add_(0, tok, (act if inputs is None else inputs(act)) @ w_down.t())
    return out


def _expert_grad_buffer(w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """An uninitialized [E, ...] gradient whose experts without tokens are zero (the others get written)."""
    grad = torch.empty_like(w)
    for e, n in enumerate(counts):
        if not n:
            grad[e].zero_()
    return grad


def expert_slices(counts: list[int]):
    """(expert, slice of its rows) for every expert with rows, in order; rows are grouped by expert."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def routed_swiglu(x: torch.Tensor, gates: torch.Tensor, token: torch.Tensor, counts: list[int],
                  w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """sum over routed (token, expert) pairs of gate * SwiGLU_expert(x[token]) -> [N, D].

    x [N, D]; token [S] and gates [S] sorted by expert, ``counts[e]`` pairs for expert e;
    w_gate, w_up [E, I, D]; w_down [E, D, I]."""
    multiple = _row_multiple(x)
    if multiple > 1:
        token, gates, counts = _pad_groups(token, gates, counts, multiple)
    return _RoutedSwiGLU.apply(x, gates, token, counts, w_gate, w_up, w_down)


CPU_LOW_PRECISION_ROW_MULTIPLE = 32


def _row_multiple(x: torch.Tensor) -> int:
    """Row-count granularity of the per-expert matmuls. On a CPU in bf16/fp16 the matmul library
    compiles a kernel for every new shape, and expert row counts change every step (a nano-sized expert
    layer then costs 3x, `benchmarks/train_kernels.py --sections experts`); rounding the counts up to a
    multiple of 32 makes the shapes recur."""
    low = compute_dtype(x) in (torch.bfloat16, torch.float16)
    return CPU_LOW_PRECISION_ROW_MULTIPLE if x.device.type == "cpu" and low else 1


def _pad_groups(token: torch.Tensor, gates: torch.Tensor, counts: list[int], multiple: int):
    """Pads each expert's rows to a multiple of ``multiple`` with rows that read token 0 and carry gate 0:
    they add exactly zero to the output and to every gradient."""
    padded = [-(-n // multiple) * multiple for n in counts]
    if padded == counts:
        return token, gates, counts
    token_parts, gate_parts = [], []
    for (e, rows), n in zip(expert_slices(counts), (n for n in padded if n), strict=True):
        extra = n - counts[e]
        token_parts += [token[rows], token.new_zeros(extra)]
        gate_parts += [gates[rows], gates.new_zeros(extra)]
    return torch.cat(token_parts), torch.cat(gate_parts), padded


def routed_swiglu_reference(x: torch.Tensor, gates: torch.Tensor, token: torch.Tensor, counts: list[int],
                            w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """What ``routed_swiglu`` computes, in plain autograd: per expert, gather its rows, SwiGLU, scale by
    the gate, scatter-add into the output."""
    out = torch.zeros_like(x)
    for e, rows in expert_slices(counts):
        tok = token[rows]
        act = F.silu(x[tok] @ w_gate[e].t()) * (x[tok] @ w_up[e].t())
        out = out.index_add(0, tok, (gates[rows, None] * act) @ w_down[e].t())
    return out


def gathered_swiglu(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """What ``routed_swiglu`` computes, with static shapes: each row's top-k experts' weights are gathered
    ([N, K, I, D]) and applied with batched products, so no shape depends on the routing (what a compiled
    graph or a CUDA graph needs; gpt-fast's MoE does the same). Each row reads its own K experts' weights:
    at one row per step the bytes of the grouped path, at many rows more. x [N, D], idx/gates [N, K]."""
    act = F.silu(torch.einsum("nd,nkid->nki", x, w_gate[idx])) * torch.einsum("nd,nkid->nki", x, w_up[idx])
    return torch.einsum("nki,nkdi->nd", gates.to(act.dtype)[..., None] * act, w_down[idx])


def grouped_swiglu(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w_gate: torch.Tensor,
                   w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """What ``gathered_swiglu`` computes, with its static shapes, but each routed-to expert's weights read once
    for all its rows, as the grouped path does (torchtitan's GroupedExperts; vLLM's fused MoE): the N*K (row,
    expert) pairs sorted by expert, each expert's pairs one group of a grouped GEMM (``torch._grouped_mm``,
    groups given by their end offsets; an expert no row chose is an empty group, its weights never read).
    Every shape is N*K or E whatever the routing, so a compiled step and a CUDA graph keep one shape. The K
    products of a row are summed in fp32. x [N, D], idx/gates [N, K] -> [N, D]; ``grouped_mm_runs`` says
    where it runs."""
    N, K = idx.shape
    pairs = idx.flatten()  # [P]
    order = pairs.argsort(stable=True)  # the pairs by expert
    rows = order.div(K, rounding_mode="floor")  # [P]: the row of x each sorted pair reads
    counts = torch.zeros(w_gate.shape[0], dtype=torch.int32, device=idx.device)
    counts.index_add_(0, pairs, torch.ones_like(pairs, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)  # [E]: where each expert's group ends
    xs = x[rows]  # [P, D]
    act = F.silu(torch._grouped_mm(xs, w_gate.transpose(-2, -1), offs=ends)) \
        * torch._grouped_mm(xs, w_up.transpose(-2, -1), offs=ends)  # [P, I]
    act = act * gates.flatten()[order, None].to(act.dtype)
    ys = torch._grouped_mm(act, w_down.transpose(-2, -1), offs=ends)  # [P, D]
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, ys.float()).to(x.dtype)


# ==== the head loss =================================================================================

# Next-token cross-entropy fused with the output head, one chunk of rows at a time.
#
# The [tokens, vocab] logits are the largest activation of a training step (V3's vocabulary has 129,280
# entries). The plain path builds them, then their log-softmax, then in backward a gradient of the same
# size: three fresh full-size buffers and several passes over memory. Here each chunk of rows gets its
# logits, its loss and its logit gradient in one buffer that is reused for the next chunk, and the
# gradients of the hidden states and of the head weight are formed right away, so autograd only keeps
# those two (the size of the input and of the weight) until backward. The matmuls are the same ones the
# plain path runs; what goes away is the memory traffic and the allocations around them. The price: the
# head-weight gradient ([V, D], fp32) exists from the forward pass on, once per loss term (MTP adds one).

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
    """Sum of per-token losses / number of labelled tokens (0 when none is labelled: a chat window without
    an assistant token); with ``grads = (grad_h, grad_w)`` also writes d loss / d h [N, D] and d loss /
    d weight [V, D] (softmax dtype) into them."""
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
    return total / count.clamp(min=1)


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
    """The unfused reference: ``F.cross_entropy`` on logits [..., V] in fp32 (or wider); 0 when no
    position is labelled (where F.cross_entropy's mean is 0/0)."""
    wide = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(wide, labels.flatten(), ignore_index=ignore_index, reduction="sum")
    return total / (labels != ignore_index).sum().clamp(min=1)


# ==== attention =====================================================================================


def causal_mask(T: int, S: int, start_pos: int, device, mask: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B|1, T, S]: query i (at position start_pos + i) sees keys 0..start_pos + i, and ``mask``."""
    q_pos = torch.arange(start_pos, start_pos + T, device=device)[:, None]
    allowed = (torch.arange(S, device=device)[None, :] <= q_pos).unsqueeze(0)
    return allowed if mask is None else allowed & mask


EXPLICIT_SCORES_LIMIT = 1 << 26  # B*H*T*S scores; above it the memory of explicit scores outweighs their speed


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q, k [B, H, T|S, d_qk], v [B, H, S, d_v]; mask: bool
    [B|1, 1, T, S] (True = attend) or None for causal. Returns [B, H, T, d_v].

    Picks the fastest exact kernel for the case. On a CPU, for short sequences, two batched matmuls
    around a softmax beat PyTorch's flash kernel (2x in bf16, where the softmax still accumulates in
    fp32 internally; even in fp32); their [B, H, T, S] scores cost memory, so long sequences go to
    SDPA's fused kernels, whose flash variants want equal q/k/v head dims: V is zero-padded there
    (exact: the padded output columns are sliced off)."""
    d_v = v.shape[-1]
    B, H, T, S = *q.shape[:3], k.shape[2]
    if q.device.type == "cpu" and B * H * T * S <= EXPLICIT_SCORES_LIMIT:
        keep = mask if mask is not None else causal_mask(T, S, S - T, q.device)
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        scores = torch.baddbmm(bias.expand(B, H, T, S).flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2),
                               alpha=scale)  # [B*H, T, S]: scaled and masked in one op
        return (scores.softmax(dim=-1) @ v.flatten(0, 1)).unflatten(0, (B, H))
    if d_v < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - d_v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[..., :d_v]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """What ``attention_core`` computes, written out: softmax(q k^T * scale, masked) v (causal when
    ``mask`` is None)."""
    T, S = q.shape[2], k.shape[2]
    keep = mask if mask is not None else causal_mask(T, S, S - T, q.device).unsqueeze(1)
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
