"""The CPU decode kernels as ``torch.library`` custom ops: ``torch.ops.dsv3.<name>``.

Each op takes tensors and scalars only (no descriptors, no raw addresses) and has three registrations:

* its PyTorch reference, the op's implementation on every device and the fallback on the CPU (no C build,
  ``DSV3_DECODE_KERNELS=0``, a build refused for its ABI, or tensors the kernel does not read: another dtype,
  a non-contiguous weight, more than ``MAX_KERNEL_ROWS`` rows);
* its CPU kernel, the C function of ``decode_kernels.c`` (through ``decode_kernels``' loader);
* its fake, the output's shape and dtype, so that ``torch.compile(fullgraph=True)`` traces a step that calls it.

So the same step runs eagerly or compiled, with or without the C build, and gives the same numbers either
way up to the kernels' documented roundings (``tests/kernels/test_ops.py`` checks each op against its
reference through ``torch.ops.dsv3``). The ops read FP8 weights in place: an e4m3 weight [N, K] with its
block scales ``scale_inv`` [ceil(N/128), ceil(K/128)] fp32, as checkpoints store them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv3.kernels import decode_kernels as dk  # dk._load() at each call: a benchmark may swap the library
from dsv3.kernels.decode_kernels import (
    A_KIND,
    FP8_SCALE_SHIFT,
    MAX_KERNEL_ROWS,
    W_KIND,
    ExpertWeights,
    Weight,
    mla_decode_reference,
    paged_rows,
    swiglu_experts_reference,
)
from dsv3.model.moe import gate_values, select_experts

__all__ = ["linear", "mla_decode", "rms_norm", "route", "scan_logits", "swiglu_experts"]


def _on_cpu(*tensors: Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _kernel_scale(scale_inv: Tensor | None) -> Tensor | None:
    """The C side's FP8 scales (scale_inv * 256, fp32 contiguous), or None."""
    return None if scale_inv is None else (scale_inv.float() * FP8_SCALE_SHIFT).contiguous()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _reads(w: Tensor, scale_inv: Tensor | None, x: Tensor) -> bool:
    """Whether the kernels read weight ``w`` (with its scales) for activations ``x``."""
    kind = W_KIND.get(w.dtype)
    return (kind is not None and (kind == 2) == (scale_inv is not None) and x.dtype in A_KIND and w.is_contiguous()
            and _on_cpu(x, w, scale_inv) and 0 < _rows(x) <= MAX_KERNEL_ROWS)


# ---- linear: x [..., K] @ W^T -> [..., N] ------------------------------------------------------------------


@torch.library.custom_op("dsv3::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, scale_inv: Tensor | None = None) -> Tensor:
    """x [..., K] times weight [N, K] (fp32, bf16, or FP8 with its block scales) transposed, in x's dtype."""
    return F.linear(x, Weight(weight, scale_inv, x.dtype).dense().to(x.dtype))


@linear.register_kernel("cpu")
def _linear_cpu(x: Tensor, weight: Tensor, scale_inv: Tensor | None = None) -> Tensor:
    lib = dk._load()[0]
    if lib is None or not _reads(weight, scale_inv, x):
        return linear._init_fn(x, weight, scale_inv)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    N, K = weight.shape
    out = x2.new_empty(x2.shape[0], N)
    scale = _kernel_scale(scale_inv)  # held until the call returns
    lib.dsv3_linear(weight.data_ptr(), _ptr(scale), W_KIND[weight.dtype], N, K, x2.data_ptr(),
                    A_KIND[x.dtype], x2.shape[0], out.data_ptr(), A_KIND[x.dtype], torch.get_num_threads())
    return out.view(*x.shape[:-1], N)


@linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor, scale_inv: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- swiglu_experts: the routed (or shared) experts of a step's rows -----------------------------------------


@torch.library.custom_op("dsv3::swiglu_experts", mutates_args=())
def swiglu_experts(x: Tensor, idx: Tensor, gates: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor,
                   gate_scale: Tensor | None = None, up_scale: Tensor | None = None,
                   down_scale: Tensor | None = None, add_to: Tensor | None = None) -> Tensor:
    """sum_j gates[m, j] * SwiGLU_{idx[m, j]}(x[m]) for x [M, D], idx/gates [M, K], stacked experts gate, up
    [E, I, D] and down [E, D, I] (FP8 with scales [E, ...]); plus ``add_to`` [M, D] when given (the kernel
    adds into a copy of it in fp32, one rounding, as the block kernel does)."""
    experts = ExpertWeights(Weight(gate_w, gate_scale, x.dtype), Weight(up_w, up_scale, x.dtype),
                            Weight(down_w, down_scale, x.dtype))
    out = swiglu_experts_reference(x, idx, gates, experts)
    return out if add_to is None else add_to + out


@swiglu_experts.register_kernel("cpu")
def _swiglu_experts_cpu(x, idx, gates, gate_w, up_w, down_w, gate_scale=None, up_scale=None, down_scale=None,
                        add_to=None):
    lib = dk._load()[0]
    weights = ((gate_w, gate_scale), (up_w, up_scale), (down_w, down_scale))
    if (lib is None or not all(_reads(w, s, x) for w, s in weights) or len({w.dtype for w, _ in weights}) != 1
            or not _on_cpu(idx, gates, add_to)):
        return swiglu_experts._init_fn(x, idx, gates, gate_w, up_w, down_w, gate_scale, up_scale, down_scale, add_to)
    x = x.contiguous()
    E, I, D = gate_w.shape
    out = add_to.clone(memory_format=torch.contiguous_format) if add_to is not None else x.new_empty(x.shape)
    idx, gates = idx.contiguous().long(), gates.contiguous().float()
    scales = [_kernel_scale(s) for _, s in weights]
    lib.dsv3_swiglu_experts(gate_w.data_ptr(), up_w.data_ptr(), down_w.data_ptr(), *map(_ptr, scales),
                            W_KIND[gate_w.dtype], E, I, D, x.data_ptr(), A_KIND[x.dtype], x.shape[0], idx.data_ptr(),
                            gates.data_ptr(), idx.shape[1], out.data_ptr(), A_KIND[x.dtype], int(add_to is not None),
                            torch.get_num_threads())
    return out


@swiglu_experts.register_fake
def _swiglu_experts_fake(x, idx, gates, gate_w, up_w, down_w, gate_scale=None, up_scale=None, down_scale=None,
                         add_to=None):
    return torch.empty_like(x)


# ---- route: the router's choice of experts and their gate values --------------------------------------------


@torch.library.custom_op("dsv3::route", mutates_args=())
def route(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int,
          softmax: bool, group_sum: bool, normalize: bool, route_scale: float) -> tuple[Tensor, Tensor]:
    """``Router.forward``'s (expert indices [M, K] int64, gate values [M, K] fp32) for x [M, D] and the
    router's weight [E, D]: sigmoid (or ``softmax``) scores in fp32, ``bias`` (noaux_tc) added to select,
    the ``topk_group`` best of ``n_group`` groups (scored by their two best with ``group_sum``, else their best),
    the top k, the gate values normalised (``normalize``) and scaled."""
    logits = F.linear(x.float(), weight.float())
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    idx = select_experts(scores, bias, n_group, topk_group, top_k, group_sum)
    return idx, gate_values(scores, idx, normalize, route_scale)


@route.register_kernel("cpu")
def _route_cpu(x, weight, bias, top_k, n_group, topk_group, softmax, group_sum, normalize, route_scale):
    lib = dk._load()[0]
    E, D = weight.shape
    if (lib is None or x.dtype not in A_KIND or not _on_cpu(weight, bias) or E % n_group != 0
            or not 0 < top_k <= E // n_group * topk_group):
        return route._init_fn(x, weight, bias, top_k, n_group, topk_group, softmax, group_sum, normalize,
                              route_scale)
    x, weight = x.contiguous(), weight.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    M = x.shape[0]
    idx, gates = torch.empty(M, top_k, dtype=torch.long), torch.empty(M, top_k)
    lib.dsv3_route(weight.data_ptr(), _ptr(bias), E, D, x.data_ptr(), A_KIND[x.dtype], M, int(softmax), n_group,
                   topk_group, int(group_sum), top_k, int(normalize), float(route_scale), idx.data_ptr(),
                   gates.data_ptr(), torch.get_num_threads())
    return idx, gates


@route.register_fake
def _route_fake(x, weight, bias, top_k, n_group, topk_group, softmax, group_sum, normalize, route_scale):
    return x.new_empty(x.shape[0], top_k, dtype=torch.long), x.new_empty(x.shape[0], top_k, dtype=torch.float32)


# ---- mla_decode: the absorbed attention of a decode step ----------------------------------------------------


@torch.library.custom_op("dsv3::mla_decode", mutates_args=())
def mla_decode(q: Tensor, cos: Tensor, sin: Tensor, w_uk: Tensor, w_uv: Tensor, kv: Tensor, pe: Tensor,
               bias: Tensor | None, scale: float, table: Tensor | None = None, shift: Tensor | None = None,
               slots: int = 0) -> Tensor:
    """MLA's absorbed attention from the query projection to the heads' outputs: q [B, T, H, nope + rope];
    cos/sin [B|1, T, rope/2] fp32; W_UK [H, nope, r], W_UV [H, v, r]; the latent cache's rows kv [B, S, r],
    pe [B, S, rope]; bias [B|1, T, S] (-inf hides a key) or None. Returns [B, T, H * v] in q's dtype.

    A paged cache (``LatentCache.paged``): kv [P, page_tokens, r] and pe [P, page_tokens, rope] are one layer's
    pages, ``table`` [B, n] int32 (-1: no page) and ``shift`` [B] int64 (None: 0) place each row's slots, and
    the rows' first ``slots`` slots are attended (S = slots). A slot a row does not hold must have bias -inf."""
    if table is not None:
        kv, pe = paged_rows(kv, pe, table, shift, q.shape[0], slots)
    return mla_decode_reference(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale)


def _pages_read(kv: Tensor, pe: Tensor, table: Tensor | None, shift: Tensor | None, rows: int, slots: int) -> bool:
    """Whether the kernel reads these pages through this table and shift (or there is none)."""
    if table is None:
        return shift is None
    return (kv.shape[:2] == pe.shape[:2] and table.dtype == torch.int32 and table.dim() == 2
            and table.stride(1) == 1 and table.shape[0] >= rows
            and table.shape[1] > 0 and slots > 0 and _on_cpu(table, shift)
            and (shift is None or (shift.dtype == torch.int64 and shift.dim() == 1 and shift.is_contiguous()
                                   and shift.shape[0] >= rows)))


@mla_decode.register_kernel("cpu")
def _mla_decode_cpu(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale, table=None, shift=None, slots=0):
    lib = dk._load()[0]
    if (lib is None or q.dtype not in A_KIND or kv.dtype not in A_KIND or pe.dtype != kv.dtype
            or not _on_cpu(cos, sin, w_uk, w_uv, kv, pe, bias) or w_uk.dtype not in A_KIND
            or w_uv.dtype != w_uk.dtype or any(t.stride(-1) != 1 for t in (kv, pe, w_uk, w_uv))
            or not _pages_read(kv, pe, table, shift, q.shape[0], slots)):
        return mla_decode._init_fn(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale, table, shift, slots)
    B, T, H, _ = q.shape
    nope, r, v, p = w_uk.shape[1], w_uk.shape[2], w_uv.shape[1], pe.shape[-1]
    q, cos, sin = q.contiguous(), cos.float().contiguous(), sin.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    S = kv.shape[1] if table is None else slots
    pages = (None, 0, 0) if table is None else (table.data_ptr(), table.stride(0), table.shape[1])
    out = q.new_empty(B, T, H * v)
    lib.dsv3_mla_decode(q.data_ptr(), A_KIND[q.dtype], cos.data_ptr(), sin.data_ptr(),
                        0 if cos.shape[0] == 1 else cos.stride(0), w_uk.data_ptr(), w_uk.stride(0), w_uk.stride(1),
                        w_uv.data_ptr(), w_uv.stride(0), w_uv.stride(1), A_KIND[w_uk.dtype], kv.data_ptr(),
                        pe.data_ptr(), A_KIND[kv.dtype], B, T, H, S, nope, p, r, v, kv.stride(0),
                        kv.stride(1), pe.stride(0), pe.stride(1), *pages, _ptr(shift), kv.shape[1], kv.shape[0],
                        _ptr(bias), 0 if bias is None or bias.shape[0] == 1 else bias.stride(0), scale, out.data_ptr(),
                        torch.get_num_threads())
    return out


@mla_decode.register_fake
def _mla_decode_fake(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale, table=None, shift=None, slots=0):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H * w_uv.shape[1])


# ---- rms_norm -----------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv3::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., n] with ``weight`` [n]: normalised in fp32, back to x's dtype, times the weight
    (``RMSNorm.forward``'s roundings; the kernel sums the squares in fp32 in its own fixed order)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@rms_norm.register_kernel("cpu")
def _rms_norm_cpu(x, weight, eps):
    lib = dk._load()[0]
    if (lib is None or x.dtype not in A_KIND or weight.dtype != x.dtype or not weight.is_contiguous()
            or not _on_cpu(weight) or x.numel() == 0):
        return rms_norm._init_fn(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    dk._declare_block(lib)[1](x.data_ptr(), weight.data_ptr(), eps, A_KIND[x.dtype], _rows(x), x.shape[-1],
                           out.data_ptr())
    return out


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


# ---- scan_logits: a step's greedy pick and finiteness check -------------------------------------------------


@torch.library.custom_op("dsv3::scan_logits", mutates_args=())
def scan_logits(logits: Tensor) -> Tensor:
    """For each row of logits [..., V]: the first index of its largest value (``torch.argmax``'s choice), or
    -1 when the row holds a NaN or an infinity; int64 [rows]."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[-1] == 0:
        return torch.full((flat.shape[0],), -1, dtype=torch.long, device=logits.device)
    return flat.argmax(dim=-1).masked_fill(~flat.isfinite().all(dim=-1), -1)


@scan_logits.register_kernel("cpu")
def _scan_logits_cpu(logits):
    lib = dk._load()[0]
    if lib is None or logits.dtype not in A_KIND or logits.dim() == 0 or not logits.is_contiguous():
        return scan_logits._init_fn(logits)
    V = logits.shape[-1]
    out = torch.empty(logits.shape[:-1].numel(), dtype=torch.long)
    lib.dsv3_scan_logits(logits.data_ptr(), A_KIND[logits.dtype], out.shape[0], V, V, out.data_ptr())
    return out


@scan_logits.register_fake
def _scan_logits_fake(logits):
    return logits.new_empty(logits.shape[:-1].numel(), dtype=torch.long)
