"""Matrix-vector kernels for the decode step on a CPU: ``decode_kernels.c`` (AVX2/FMA), compiled with
the system C compiler at first use and cached, each beside the plain PyTorch reference it must equal.

Why: a decode step multiplies one row (or a few) by every weight matrix, so its speed is the speed of
reading the weights. PyTorch's single-row matmuls reach a fraction of the memory bandwidth (and less in
bf16 than in fp32 on CPUs without native bf16 dot products), and resident FP8 weights had to be dequantized
into a full bf16 copy first. The C kernels read fp32, bf16 or FP8 (128x128 blocks) weights in place,
four weight rows at a time, converting them in registers (FP8 with integer shifts, not F16C, which is too
slow to keep up with memory), and one call computes all routed experts of a step. The absorbed attention
is one call too. Where the CPU has AVX512-BF16, bf16 weights times bf16 activations and a bf16 model's
attention over a bf16 cache take its bf16 dot products instead of AVX2 FMAs (``bf16_dots``; on Intel CPUs the
GEMVs take AVX-512 FMAs instead, about four times the dot products' rate there); with AVX-512F the GEMVs of
several rows, and of FP8 weights from one row, run 512-bit FMAs that give the AVX2 sums to the bit
(``int_weights.avx512`` switches both). A
row's result does not depend on how many rows share the call (the summation order is fixed), so batched and
single-row decode give the same numbers. ``benchmarks/decode_kernels_speed.py`` measures them against the read
bandwidth.

The single kernels are called as custom ops (``torch.ops.dsv3.*``, registered by ``dsv3.kernels.ops`` on
import of ``dsv3.kernels``); the functions here wrap them for the decode paths' weight views (``Weight``,
``ExpertWeights``), and this module keeps the loader and the block and step descriptors. When the kernels
cannot be used (not x86-64 Linux with AVX2/FMA, no C compiler, a failed build, a build of another ABI, the
tensors on another device, or ``DSV3_DECODE_KERNELS=0``) every function here computes the same thing
with PyTorch ops; ``kernel_status()`` says which one runs and why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv3.kernels import c_build
from dsv3.model.mla import LatentCache
from dsv3.precision.fp8 import dequantize_weight_blocks

SOURCE = Path(__file__).with_name("decode_kernels.c")
W_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
A_KIND = {torch.float32: 0, torch.bfloat16: 1}
ABI = 7  # decode_kernels.c's DSV3_KERNELS_ABI: the calling interface this module's declarations (_declare) match
MAX_KERNEL_ROWS = 64  # more rows than this: a real matmul (PyTorch's) is the better tool
FP8_SCALE_SHIFT = 256.0  # the C side's FP8 scales are scale_inv * 256 (its powers of two do the rest exactly)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dsv3_linear.argtypes = [p, p, i32, i64, i64, p, i32, i64, p, i32, i32]
    lib.dsv3_swiglu_experts.argtypes = [p, p, p, p, p, p, i32, i64, i64, i64, p, i32, i64, p, p, i64, p, i32,
                                        i32, i32]
    lib.dsv3_route.argtypes = [p, p, i64, i64, p, i32, i64, i32, i64, i64, i32, i64, i32, ctypes.c_float, p, p, i32]
    lib.dsv3_mla_decode.argtypes = [p, i32, p, p, i64, p, i64, i64, p, i64, i64, i32, p, p, i32] + [i64] * 12 + [
        p, i64, i64, p, i64, i64, p, i64, ctypes.c_float, p, i32]
    lib.dsv3_scan_logits.argtypes = [p, i32, i64, i64, i64, p]
    for fn in (lib.dsv3_linear, lib.dsv3_swiglu_experts, lib.dsv3_route, lib.dsv3_mla_decode, lib.dsv3_scan_logits):
        fn.restype = i32
    return lib


def library_path() -> Path:
    """Where the build of this source is cached."""
    return c_build.library_path(SOURCE)


def _with_bf16_dots(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library declared, its bf16 dot products on unless ``DSV3_DECODE_BF16_DOTS=0``."""
    lib = _declare(lib)
    lib.dsv3_bf16_dots.argtypes, lib.dsv3_bf16_dots.restype = [ctypes.c_int], ctypes.c_int
    lib.dsv3_bf16_dots(0 if os.environ.get("DSV3_DECODE_BF16_DOTS", "1") == "0" else 1)
    lib.dsv3_amx.argtypes, lib.dsv3_amx.restype = [ctypes.c_int], ctypes.c_int
    lib.dsv3_amx(0 if os.environ.get("DSV3_DECODE_AMX", "1") == "0" else 1)
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "ok") or (None, why not). Built once per source version, then reused."""
    return c_build.load(SOURCE, "dsv3_abi", ABI, _with_bf16_dots, "the C kernels")


def kernel_status() -> str:
    """"ok" when the C kernels run, else why the PyTorch path runs instead."""
    return _load()[1]


def kernels_available() -> bool:
    return _load()[0] is not None


def bf16_dots(on: bool | None = None) -> bool:
    """Whether bf16 x bf16 arithmetic runs in AVX512-BF16 dot products (VDPBF16PS) rather than AVX2 FMAs in
    fp32: the GEMVs of bf16 weights with bf16 activations (all but the experts' down projections, whose input
    the kernel keeps in fp32; products exact and sums fp32 either way), and a bf16 model's attention over a
    bf16 cache (with its queries and softmax weights rounded to bf16); on Intel CPUs with the AVX-512 path on
    (``int_weights.avx512``) the GEMVs take FMAs whatever this says. On by default where the CPU has
    AVX512-BF16, off with ``DSV3_DECODE_BF16_DOTS=0``. ``on`` turns it on (where the CPU allows) or off for
    this process; returns the state."""
    lib = _load()[0]
    if lib is None:
        return False
    return bool(lib.dsv3_bf16_dots(-1 if on is None else int(on)))


def amx(on: bool | None = None) -> bool:
    """Whether a bf16 model's attention over a bf16 cache runs in AMX tiles (Intel's TDPBF16PS, 16 x 16 x 32
    products an instruction) where the bf16 dot products are on (``bf16_dots``): the same roundings (queries
    and softmax weights in bf16, products exact, sums fp32), summed in another order. Its bf16 GEMVs of bf16
    activations take the tiles too (the projections, the output head, a dense MLP and the shared experts, where
    a matrix's columns are a multiple of 32; not the routed experts, which a decode step gives a row or two
    each), whatever the row count, so a row's bits do not depend on the rows beside it. On by default where the
    CPU has AMX-BF16 and the kernel lets the process use it, off with ``DSV3_DECODE_AMX=0``. ``on`` turns it on
    (where allowed) or off for this process; returns whether the attention takes it now (false while the dot
    products are off)."""
    lib = _load()[0]
    if lib is None:
        return False
    return bool(lib.dsv3_amx(-1 if on is None else int(on))) and bool(lib.dsv3_bf16_dots(-1))


class Weight:
    """A weight matrix [N, K] as the kernels read it: fp32, bf16, or FP8 e4m3 with 128x128 block scales
    (``scale_inv`` [ceil(N/128), ceil(K/128)]); ``dtype`` is the compute dtype of the reference path.
    Holds the module's own tensors (no copy), plus the FP8 scales times 256 (a few floats per block)."""

    def __init__(self, w: torch.Tensor, scale_inv: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        self.w = w
        self.scale_inv = scale_inv
        self.dtype = dtype or (w.dtype if scale_inv is None else torch.bfloat16)
        self.kernel_scale = None if scale_inv is None else (scale_inv.float() * FP8_SCALE_SHIFT).contiguous()

    @property
    def kind(self) -> int | None:
        return W_KIND.get(self.w.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the matrix it stands for."""
        return tuple(self.w.shape)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T in x's dtype through the kernels' op."""
        return torch.ops.dsv3.linear(x, self.w, self.scale_inv)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same without the kernels: the weight in x's dtype, then PyTorch's matmul."""
        return F.linear(x, self.dense().to(x.dtype))

    def dense(self) -> torch.Tensor:
        """The weight in the compute dtype (the reference path; FP8 is dequantized here, per call)."""
        if self.scale_inv is None:
            return self.w
        return dequantize_weight_blocks(self.w, self.scale_inv, self.dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(x: torch.Tensor, weight: Weight, use_kernel: bool = True) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype: ``torch.ops.dsv3.linear``, or the reference without kernels."""
    return weight.apply(x) if use_kernel else weight.reference(x)


class ExpertWeights:
    """Stacked SwiGLU experts as the kernels read them: gate, up [E, I, D] and down [E, D, I], each a
    :class:`Weight` over the stacked tensor (FP8 scales [E, ...])."""

    def __init__(self, gate: Weight, up: Weight, down: Weight):
        self.gate, self.up, self.down = gate, up, down

    @property
    def n_experts(self) -> int:
        return self.gate.w.shape[0]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's dense weights in the compute dtype (the reference path)."""
        return tuple(_dense_expert(w, e) for w in (self.gate, self.up, self.down))


def _dense_expert(w: Weight, e: int) -> torch.Tensor:
    if w.scale_inv is None:
        return w.w[e]
    return dequantize_weight_blocks(w.w[e], w.scale_inv[e], w.dtype)


def swiglu_experts(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, experts: ExpertWeights,
                   add_to: torch.Tensor | None = None, use_kernel: bool = True) -> torch.Tensor:
    """sum_j gates[m, j] * SwiGLU_{idx[m, j]}(x[m]) for x [M, D], idx/gates [M, K]; plus ``add_to`` [M, D]
    when given: ``torch.ops.dsv3.swiglu_experts``, or the reference without kernels."""
    if not use_kernel:
        out = swiglu_experts_reference(x, idx, gates, experts)
        return out if add_to is None else add_to + out
    g, u, d = experts.gate, experts.up, experts.down
    return torch.ops.dsv3.swiglu_experts(x, idx, gates, g.w, u.w, d.w, g.scale_inv, u.scale_inv, d.scale_inv, add_to)


def swiglu_experts_reference(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor,
                             experts: ExpertWeights) -> torch.Tensor:
    """What ``swiglu_experts`` computes, one (row, expert) pair at a time, in x's dtype."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        w_gate, w_up, w_down = (t.to(x.dtype) for t in experts.expert(e))
        xe = x[rows]
        act = F.silu(xe @ w_gate.t()) * (xe @ w_up.t()) * gates[rows, slot, None].to(x.dtype)
        out.index_add_(0, rows, act @ w_down.t())
    return out


def scan_logits(logits: torch.Tensor) -> list[int] | None:
    """For each row of logits [..., V] (fp32 or bf16, contiguous, CPU): the first index of its largest value
    (``torch.argmax``'s choice), or -1 when the row holds a NaN or an infinity; in one C call
    (``torch.ops.dsv3.scan_logits``), or None when the kernels are not built or cannot read the tensor. The
    engine's check and greedy pick of a decode step's logits (the fallback is ``sampling.all_finite`` and
    ``sampling.greedy_tokens`` per row)."""
    if (_load()[0] is None or logits.dtype not in A_KIND or not logits.is_cpu or logits.dim() == 0
            or not logits.is_contiguous()):
        return None
    return torch.ops.dsv3.scan_logits(logits).tolist()


def latent_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor,
                               bias: torch.Tensor | None, scale: float, heads: int) -> torch.Tensor:
    """Absorbed attention over the latent cache, in fp32: softmax(scale * (q_lat kv^T + q_pe pe^T) + bias) kv
    for q_lat [B, M, r], q_pe [B, M, p] with M = T * heads (query m is step m // heads); kv [B, S, r],
    pe [B, S, p]; bias [B|1, T, S] (-inf hides a key) or None. Returns [B, M, r]."""
    B, M, _ = q_lat.shape
    S = kv.shape[1]
    kv = kv.float()
    scores = torch.baddbmm(q_lat.float() @ kv.transpose(1, 2), q_pe.float(), pe.float().transpose(1, 2),
                           beta=scale, alpha=scale)
    if bias is not None:
        scores = (scores.view(B, M // heads, heads, S) + bias.float().unsqueeze(2)).view(B, M, S)
    return scores.softmax(dim=-1) @ kv


def route(x: torch.Tensor, router, use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``Router.forward``'s (expert indices [M, K], gate values [M, K] fp32) for x [M, D], in one call
    (``torch.ops.dsv3.route``) for the scoring functions and top-k methods DeepSeek ships; anything else runs
    the router itself. A router kept in another dtype than fp32 is read through an fp32 copy, as the block
    kernel reads it (``route_constants``): the scores are the block kernel's to the bit, where PyTorch's fp32
    matmul sums a few rows in another order than one (and than the kernel), on some CPUs and thread counts."""
    method, groups = router.method, router.n_group
    plain = (router.scoring in ("sigmoid", "softmax") and method in ("noaux_tc", "group_limited_greedy", "greedy")
             and router.n_experts % groups == 0 and not router._forward_hooks and not router._forward_pre_hooks)
    if not use_kernel or not plain:
        idx, weights, _ = router(x)
        return idx, weights
    weight, bias = _fp32_router(router)
    return torch.ops.dsv3.route(x, weight, bias, router.top_k, groups if method != "greedy" else 1,
                                router.topk_group, router.scoring == "softmax", method == "noaux_tc",
                                bool(router.norm_topk_prob), float(router.route_scale))


_ROUTER_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # router -> (its tensors' versions, copies)


def _fp32_router(router) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's weight [E, D] and (noaux_tc) bias [E] in fp32: the tensors themselves when they are fp32,
    else copies made once and again only when the tensors change (a bf16 DeepSeek-V3 router is 7 MB in fp32,
    which a copy per step and layer would write and read again)."""
    bias = router.e_score_correction_bias if router.method == "noaux_tc" else None
    tensors = [t.detach() for t in (router.weight, bias) if t is not None]
    if any(t.dtype != torch.float32 for t in tensors):
        # compiled (the static step), converted in the graph: the kept copies are Python state no graph holds
        tensors = [t.float() for t in tensors] if torch.compiler.is_compiling() else _kept_copies(router, tensors)
    return tensors[0], tensors[1] if bias is not None else None


def _kept_copies(router, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 copies of a router's tensors, made again only when the tensors change (their addresses and versions;
    an inference tensor has no version counter, and cannot change outside inference mode: its address)."""
    key = tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype) for t in tensors)
    made = _ROUTER_COPIES.get(router)
    if made is None or made[0] != key:
        made = _ROUTER_COPIES[router] = (key, [t.float() for t in tensors])
    return made[1]


def mla_decode(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
               kv: torch.Tensor, pe: torch.Tensor, bias: torch.Tensor | None, scale: float,
               use_kernel: bool = True, table: torch.Tensor | None = None, shift: torch.Tensor | None = None,
               slots: int = 0) -> torch.Tensor:
    """The absorbed MLA attention of a decode step (``torch.ops.dsv3.mla_decode``, whose docstring gives the
    shapes), or the reference without kernels. W_UK/W_UV fp32 or bf16 are read in place (bf16 converted
    exactly, so the numbers are those of an fp32 copy). With ``table``, kv/pe are one layer's pages of a paged
    cache and the rows' first ``slots`` slots are read through the table and ``shift`` (``paged_rows``)."""
    if not use_kernel:
        if table is not None:
            kv, pe = paged_rows(kv, pe, table, shift, q.shape[0], slots)
        return mla_decode_reference(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale)
    return torch.ops.dsv3.mla_decode(q, cos, sin, w_uk, w_uv, kv, pe, bias, scale, table, shift, slots)


def paged_rows(kv: torch.Tensor, pe: torch.Tensor, table: torch.Tensor, shift: torch.Tensor | None, rows: int,
               slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [0, slots) of rows [0, rows) of one layer's pages kv [P, page_tokens, r], pe [P, page_tokens, rope]
    seen through ``table`` [rows, n] and ``shift`` [rows] (``LatentCache.paged``'s layout): kv [rows, slots, r]
    and pe [rows, slots, rope], a copy, with 0 in the slots a row does not hold (what the kernels read there
    only ever gets weight 0, so its value must not be a NaN of another row's page)."""
    shift = torch.zeros(table.shape[0], dtype=torch.int64, device=table.device) if shift is None else shift
    at = LatentCache.paged(kv[None], pe[None], table, shift).slots(rows, 0, slots).to(kv.device)
    held = (at >= 0)[..., None]
    at = at.clamp(min=0)
    return (torch.where(held, t.flatten(0, 1)[at], torch.zeros((), dtype=t.dtype)) for t in (kv, pe))


def mla_decode_reference(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_uk: torch.Tensor,
                         w_uv: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, bias: torch.Tensor | None,
                         scale: float, bf16_queries: bool = False) -> torch.Tensor:
    """What ``mla_decode`` computes, in PyTorch ops (fp32 inside). ``bf16_queries``: with the scaled queries
    rounded to bf16, as the AVX512-BF16 path takes them (which also rounds each tile's softmax weights)."""
    from dsv3.model.rope import apply_rope

    B, T, H, _ = q.shape
    nope, r = w_uk.shape[1], w_uk.shape[2]
    q_nope, q_pe = q.float().split([nope, q.shape[-1] - nope], dim=-1)
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk.float()).reshape(B, T * H, r)
    q_pe = apply_rope(q_pe, cos, sin).reshape(B, T * H, -1)
    if bf16_queries:
        q_lat, q_pe, scale = (q_lat * scale).bfloat16().float(), (q_pe * scale).bfloat16().float(), 1.0
    o_lat = latent_attention_reference(q_lat, q_pe, kv, pe, bias, scale, H).view(B, T, H, r)
    return torch.einsum("bthr,hvr->bthv", o_lat, w_uv.float()).reshape(B, T, -1).to(q.dtype)


# ---- a whole block's decode step in one call ------------------------------------------------------------
# ``dsv3_decode_block`` runs what FastDecode's per-op path runs for one block (decode.BlockPlan), reading
# a descriptor made once per plan (pointers to the block's own tensors, sizes, constants) and one made once
# per step (rows, RoPE rotation, cache, mask). The C side makes them and fills their fields by name
# (``Descriptor``): Python holds their addresses and the values it set, never their layout.

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Descriptor:
    """A C descriptor (``kind`` "block": one block's weights and constants, "step": one decode step, "model":
    the model around its blocks), allocated by ``dsv3_desc_new``, its fields set by name, freed with this
    object. Field values are ints, floats, tensor addresses or None (a null pointer), or dicts of them for the
    nested linear layers and experts ("q_a", "routed"). ``fields`` keeps what was set; ``address`` is what the
    kernels take. The caller keeps the tensors alive while the descriptor is used."""

    KINDS = {"block": 0, "step": 1, "model": 2}

    def __init__(self, kind: str, **fields):
        lib = _load()[0]
        self.kind = self.KINDS[kind]
        self._set = _declare_block(lib)[3]
        self.address = _declare_block(lib)[4](self.kind)
        if not self.address:
            raise MemoryError(f"no memory for a {kind} descriptor")
        weakref.finalize(self, _declare_block(lib)[5], self.address)
        self.fields: dict = {}
        self.set(**fields)

    def set(self, **fields) -> None:
        for name, value in fields.items():
            self.fields[name] = value
            for path, v in _flatten(name, value):
                if self._set(self.kind, self.address, path.encode(), 0 if v is None else int(v),
                             0.0 if v is None else float(v)) != 0:
                    raise RuntimeError(f"the kernels' descriptors have no field {path}")


def _flatten(name: str, value) -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [(f"{name}.{k}", v) for k, v in value.items()]
    return [(name, value)]


@functools.cache
def _declare_block(lib: ctypes.CDLL) -> tuple:
    block, norm, step = lib.dsv3_decode_block, lib.dsv3_rms_norm, lib.dsv3_decode_step
    block.argtypes = [_p, _p, _p]
    norm.argtypes = [_p, _p, _f32, ctypes.c_int, _i64, _i64, _p]
    step.argtypes = [_p, _p, _p, _p, _p, _p]
    block.restype = norm.restype = step.restype = ctypes.c_int
    new, free, set_field = lib.dsv3_desc_new, lib.dsv3_desc_free, lib.dsv3_desc_set
    new.argtypes, new.restype = [ctypes.c_int], _p
    free.argtypes, free.restype = [_p], None
    set_field.argtypes, set_field.restype = [ctypes.c_int, _p, ctypes.c_char_p, _i64, ctypes.c_double], ctypes.c_int
    return block, norm, step, set_field, new, free


def _block_functions() -> tuple | None:
    """(dsv3_decode_block, dsv3_rms_norm, dsv3_decode_step, ...) with their argument types, or None without the C
    kernels."""
    lib = _load()[0]
    return None if lib is None else _declare_block(lib)


def block_kernel_available() -> bool:
    return _block_functions() is not None


def block_linear(weight: Weight) -> dict | None:
    """The block kernel's view of a linear layer (the fields of a descriptor's linear layer), or None when the
    kernels cannot read it."""
    if weight.kind is None or not weight.w.is_contiguous() or weight.w.device.type != "cpu":
        return None
    N, K = weight.shape
    return {"w": weight.w.data_ptr(), "scale": _ptr(weight.kernel_scale), "kind": weight.kind, "n": N, "k": K}


def block_experts(experts: ExpertWeights) -> dict | None:
    """The block kernel's view of stacked experts (one weight kind for all three), or None."""
    parts = (experts.gate, experts.up, experts.down)
    if (any(p.kind is None or not p.w.is_contiguous() or p.w.device.type != "cpu" for p in parts)
            or len({p.kind for p in parts}) != 1):
        return None
    E, I, D = experts.gate.w.shape
    return {"gate": parts[0].w.data_ptr(), "up": parts[1].w.data_ptr(), "down": parts[2].w.data_ptr(),
            "gate_scale": _ptr(parts[0].kernel_scale), "up_scale": _ptr(parts[1].kernel_scale),
            "down_scale": _ptr(parts[2].kernel_scale), "kind": experts.gate.kind, "n_experts": E, "inter": I,
            "dim": D}


def route_constants(router) -> tuple[dict, list[torch.Tensor]] | None:
    """The router as ``dsv3_route`` reads it (fields of the block descriptor) and the tensors they point to,
    or None for a scoring function or top-k method the kernel does not implement. The weight and bias are
    read in place when fp32 (the dtype DeepSeek keeps them in), else through the fp32 copy the per-op route
    reads too (``_fp32_router``; the router computes in fp32 anyway, so the scores are the same)."""
    method, groups = router.method, router.n_group
    weight, bias = _fp32_router(router)
    tensors = [t.contiguous() for t in (weight, bias) if t is not None]
    if not (router.scoring in ("sigmoid", "softmax") and method in ("noaux_tc", "group_limited_greedy", "greedy")
            and router.n_experts % groups == 0 and all(t.device.type == "cpu" for t in tensors)):
        return None
    fields = {"router": tensors[0].data_ptr(), "router_bias": _ptr(None if bias is None else tensors[1]),
              "softmax": int(router.scoring == "softmax"), "n_group": groups if method != "greedy" else 1,
              "topk_group": router.topk_group, "group_sum": int(method == "noaux_tc"), "topk": router.top_k,
              "normalize": int(router.norm_topk_prob), "route_scale": float(router.route_scale)}
    return fields, tensors


def _cache_fields(kv: torch.Tensor, pe: torch.Tensor, table: torch.Tensor | None = None,
                  shift: torch.Tensor | None = None) -> dict:
    """A step descriptor's cache fields for the latent cache kv/pe [L, P, page_tokens, .] (last dim
    contiguous) seen through ``table`` [rows, n] int32 and ``shift`` [rows] int64 (rows contiguous;
    ``LatentCache.paged``), or, table None, the plain cache [L, B, S, .] (row b is page b)."""
    (kl, kb, ks), (pl, pb, ps) = kv.stride()[:3], pe.stride()[:3]
    return {"kv": kv.data_ptr(), "pe": pe.data_ptr(), "ckind": A_KIND[kv.dtype], "kv_lstride": kl, "kv_bstride": kb,
            "kv_sstride": ks, "pe_lstride": pl, "pe_bstride": pb, "pe_sstride": ps,
            "pages": _page_fields(table, shift, kv.shape[2], kv.shape[1])}


def _page_fields(table: torch.Tensor | None, shift: torch.Tensor | None, page_tokens: int, n_pages: int) -> dict:
    """The step descriptor's page map (``PageMap``): all null for the plain cache."""
    if table is None:
        return {"table": None, "table_stride": 0, "table_cols": 0, "shift": None, "page_tokens": page_tokens,
                "n_pages": n_pages}
    return {"table": table.data_ptr(), "table_stride": table.stride(0), "table_cols": table.shape[1],
            "shift": _ptr(shift), "page_tokens": page_tokens, "n_pages": n_pages}


def block_step(rows: int, T: int, start: int, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
               pe: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> Descriptor:
    """The per-step descriptor with its RoPE rows: cos/sin [rows|1, T, rope/2] fp32 contiguous, the cache's
    kv/pe (``_cache_fields``: with ``table`` and ``shift`` for a paged cache), bias [rows|1, T, start + T] fp32
    contiguous or None. The caller keeps the tensors alive while the step runs."""
    return Descriptor("step", rows=rows, T=T, start=start, cos=cos.data_ptr(), sin=sin.data_ptr(),
                      rot_bstride=0 if cos.shape[0] == 1 else cos.stride(0), **_cache_fields(kv, pe, table, shift),
                      bias=_ptr(bias), bias_bstride=0 if bias is None or bias.shape[0] == 1 else bias.stride(0),
                      nthreads=torch.get_num_threads())


def table_step(rows: int, T: int, table_cos: torch.Tensor, table_sin: torch.Tensor, kv: torch.Tensor,
               pe: torch.Tensor) -> Descriptor:
    """A per-step descriptor whose RoPE rows the kernels look up themselves, in the tables of cos and sin of
    positions [0, n) ([n, rope/2] fp32 contiguous), for the positions ``retarget`` points it at: made once
    for a cache (a paged cache's pool: ``retarget`` points it at each step's page table) and reused step after
    step, which saves the per-step indexing and descriptor (tens of microseconds of interpreter work a step)."""
    n, half = table_cos.shape
    return Descriptor("step", rows=rows, T=T, **_cache_fields(kv, pe), nthreads=torch.get_num_threads(),
                      table_cos=table_cos.data_ptr(), table_sin=table_sin.data_ptr(), table_len=n, half=half)


def retarget(step: Descriptor, start: int, positions: torch.Tensor, bias: torch.Tensor | None,
             table: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> Descriptor:
    """A ``table_step`` descriptor pointed at this step: its first cache slot, positions [rows|1, T] (int64,
    contiguous), bias (as ``block_step``) and, for a paged cache, its page table and shift (set only when they
    changed: a pool's rows are regrouped between steps, its pages stay). The caller keeps the tensors alive
    while the step runs."""
    step.set(start=start, positions=positions.data_ptr(),
             pos_bstride=0 if positions.shape[0] == 1 else positions.shape[1], bias=_ptr(bias),
             bias_bstride=0 if bias is None or bias.shape[0] == 1 else bias.stride(0))
    pages = step.fields["pages"]
    if table is not None or pages["table"] is not None:
        now = _page_fields(table, shift, pages["page_tokens"], pages["n_pages"])
        if now != pages:
            step.set(pages=now)
    return step


PAGE_ERROR = -3  # the kernels' status for a cache write outside a row's pages (nothing done)


def _page_error() -> ValueError:
    return ValueError("cache write at a slot outside a row's pages")


_before = threading.local()  # .fn: what before_next_call runs at this thread's next kernel call


@contextmanager
def before_next_call(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` just before this thread's next ``decode_step`` or ``decode_block`` call in the block (on
    leaving it when none came). The kernels' calls let go of the GIL: a caller that wakes another Python thread
    here (the server hands a step's events to its HTTP thread) lets that thread's Python run while the kernels
    compute, where woken earlier it took the GIL from the caller's own Python before the call."""
    _before.fn = fn
    try:
        yield
    finally:
        _run_before()


def _run_before() -> None:
    fn = getattr(_before, "fn", None)
    if fn is not None:
        _before.fn = None
        fn()


def decode_block(desc: int, step: int, x: torch.Tensor) -> bool:
    """Run one block on x [rows * T, dim] (contiguous, the block's activation dtype) in place; ``desc`` and
    ``step`` are the addresses of a "block" and a "step" ``Descriptor``. False (nothing done) when the step looks its
    RoPE rows up in a table that lacks one of its positions; ValueError (nothing done) when a slot it writes lies
    outside a row's pages (as ``LatentCache.write``)."""
    _run_before()
    status = _block_functions()[0](desc, step, x.data_ptr())
    if status == PAGE_ERROR:
        raise _page_error()
    return status == 0


def decode_step(desc: int, step: int, ids: torch.Tensor, h: torch.Tensor, logits: torch.Tensor,
                scan: torch.Tensor | None = None) -> bool:
    """Run a whole decode step: ids [rows, T] (int64, contiguous) -> the final-normed hidden states h
    [rows, T, dim] and the head's logits [rows, T, N] (both contiguous, the activation dtype), written in
    place; with ``scan`` (int64 [rows * T]), also ``scan_logits`` of those logits into it, in the same call.
    ``desc`` and ``step`` are the addresses of a "model" and a "step" ``Descriptor``. IndexError (and nothing
    computed) for an id outside the embedding, as ``nn.Embedding`` raises; False (nothing computed) as
    ``decode_block`` (and its ValueError)."""
    _run_before()
    status = _block_functions()[2](desc, step, ids.data_ptr(), h.data_ptr(), logits.data_ptr(),
                                   None if scan is None else scan.data_ptr())
    if status == -1:
        raise IndexError("index out of range in self")
    if status == PAGE_ERROR:
        raise _page_error()
    return status == 0

