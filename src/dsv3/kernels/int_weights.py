"""Decode over group-wise integer weights (int8, int4: ``dsv3.precision.int_groups``): the decode kernels'
integer paths (``int_groups.h``, a part of ``decode_kernels.c``) as ``torch.library`` custom ops, the modules
that hold such weights, and the swap of a model's experts into them.

* ``torch.ops.dsv3.int_linear(x, q, scale)``: x [..., K] times the integer weight [N, K] transposed;
* ``torch.ops.dsv3.int_swiglu_experts(x, idx, gates, gate_q, gate_s, up_q, up_s, down_q, down_s, add_to)``:
  the routed (or shared) experts of a step's rows over stacked integer experts.

An integer layer multiplies its activations rounded to int8 per group of 32 (``round_activations``, as
llama.cpp rounds them for Q8_0 and Q4_0). Each op's PyTorch reference (that rounding, the weight dequantized
in fp32, exact, then matmul in fp32, one rounding to x's dtype) is its implementation on every device and the
CPU fallback (no C build, ``DSV3_DECODE_KERNELS=0``, a build of another ABI, more than ``MAX_KERNEL_ROWS``
rows); the C kernels read the weights in place as bytes and sum byte products exactly in int32, on an
AVX-512 VNNI path or the AVX2 baseline chosen at run time (``avx512``, ``vnni``). They are the
fp32/bf16/FP8 kernels' own ``dsv3_linear`` and ``dsv3_swiglu_experts`` with an integer weight kind, which is
also how the block and step kernels read integer experts (``IntExpertWeights.block_view``).

``IntLinear`` and ``IntExperts`` are the modules of a model loaded with ``--weights int8|int4``: every
projection the decode step reads as a matrix (routed and shared experts, dense MLPs, attention's query,
latent and output projections) becomes integer groups at that width, the output head at 8 bits
(``dsv3.precision.int_groups.int_bits`` names them); ``kv_b_proj``, the routers, the norms and the embedding keep
their dtype. ``IntWeight`` is an ``IntLinear``'s weight as the decode step's kernels read it.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv3.errors import DSV3Error
from dsv3.kernels import decode_kernels as dk  # dk._load() at each call: a benchmark may swap the library
from dsv3.model.dispatch import ExpertRows
from dsv3.model.experts import PROJECTIONS, GroupedExperts
from dsv3.model.kernels import routed_forward
from dsv3.model.moe import MLP, MoE
from dsv3.precision.int_groups import GROUP, bits_of, dequantize, int_bits, quantize, round_activations

__all__ = ["IntExperts", "IntLinear", "IntWeight", "int_kernel_status", "to_int_weights"]

KIND = {8: 3, 4: 4}  # decode_kernels.c's W_INT8, W_INT4 by width


def int_kernel_status() -> str:
    """"ok" when the integer-weight C kernels (the decode kernels') run, else why the PyTorch references run."""
    return dk.kernel_status()


def avx512(on: bool | None = None) -> bool:
    """Whether the kernels take their AVX-512 paths (where the CPU has AVX-512F/BW) rather than the AVX2 ones;
    ``on`` chooses for this process (the tests run both). The integer GEMV's AVX-512 path needs AVX512-VNNI
    too (``vnni``). Returns the state."""
    lib = dk._load()[0]
    if lib is None:
        return False
    lib.dsv3_int_avx512.argtypes, lib.dsv3_int_avx512.restype = [ctypes.c_int], ctypes.c_int
    return bool(lib.dsv3_int_avx512(-1 if on is None else int(on)))


def vnni() -> bool:
    """Whether the integer GEMV takes its AVX-512 VNNI path (``avx512`` on, and the CPU has AVX512-VNNI)
    rather than the AVX2 one; both multiply the same int8 activations."""
    lib = dk._load()[0]
    if lib is None:
        return False
    lib.dsv3_int_vnni.argtypes, lib.dsv3_int_vnni.restype = [], ctypes.c_int
    return bool(lib.dsv3_int_vnni())


def _reads(x: Tensor, *pairs: tuple[Tensor, Tensor]) -> bool:
    """Whether the C kernels read these activations and (values, scales) pairs."""
    return (dk._load()[0] is not None and x.dtype in dk.A_KIND and x.device.type == "cpu"
            and 0 < x.numel() // max(x.shape[-1], 1) <= dk.MAX_KERNEL_ROWS
            and all(x.shape[-1] == s.shape[-1] * GROUP for _, s in pairs[:1])
            and all(q.dtype in (torch.int8, torch.uint8) and q.is_contiguous() and q.device.type == "cpu"
                    and s.dtype == torch.float16 and s.is_contiguous() and s.device.type == "cpu" for q, s in pairs)
            and len({q.dtype for q, _ in pairs}) == 1)


# ---- int_linear ---------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv3::int_linear", mutates_args=())
def int_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [..., K] times the integer weight (q, scale) [N, K] transposed: x rounded to int8 per group
    (``round_activations``), the product in fp32, rounded once to x's dtype."""
    return F.linear(round_activations(x), dequantize(q, scale)).to(x.dtype)


@int_linear.register_kernel("cpu")
def _int_linear_cpu(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    if not _reads(x, (q, scale)):
        return int_linear._init_fn(x, q, scale)
    N, K = scale.shape[0], scale.shape[1] * GROUP
    x2 = x.reshape(-1, K).contiguous()
    out = x2.new_empty(x2.shape[0], N)
    ak = dk.A_KIND[x.dtype]
    dk._load()[0].dsv3_linear(q.data_ptr(), scale.data_ptr(), KIND[bits_of(q)], N, K, x2.data_ptr(), ak, x2.shape[0],
                              out.data_ptr(), ak, torch.get_num_threads())
    return out.view(*x.shape[:-1], N)


@int_linear.register_fake
def _int_linear_fake(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], scale.shape[-2])


# ---- int_swiglu_experts -------------------------------------------------------------------------------------


@torch.library.custom_op("dsv3::int_swiglu_experts", mutates_args=())
def int_swiglu_experts(x: Tensor, idx: Tensor, gates: Tensor, gate_q: Tensor, gate_s: Tensor, up_q: Tensor,
                       up_s: Tensor, down_q: Tensor, down_s: Tensor, add_to: Tensor | None = None) -> Tensor:
    """sum_j gates[m, j] * SwiGLU_{idx[m, j]}(x[m]) (+ ``add_to``) for x [M, D], idx/gates [M, K] and stacked
    integer experts gate, up [E, I, D], down [E, D, I]: each routed-to expert dequantized in fp32, the inputs
    of its projections (x, and the gated SwiGLU before down) rounded to int8 per group (``round_activations``),
    the sums in fp32, one rounding to x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if add_to is None else add_to.float()
    xf = round_activations(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        w_gate, w_up, w_down = (dequantize(q[e], s[e]) for q, s in ((gate_q, gate_s), (up_q, up_s), (down_q, down_s)))
        xe = xf[rows]
        act = F.silu(xe @ w_gate.t()) * (xe @ w_up.t()) * gates[rows, slot, None].float()
        out = out.index_add(0, rows, round_activations(act) @ w_down.t())
    return out.to(x.dtype)


@int_swiglu_experts.register_kernel("cpu")
def _int_swiglu_experts_cpu(x, idx, gates, gate_q, gate_s, up_q, up_s, down_q, down_s, add_to=None):
    pairs = ((gate_q, gate_s), (up_q, up_s), (down_q, down_s))
    if (not _reads(x, *pairs) or not all(t is None or t.device.type == "cpu" for t in (idx, gates, add_to))
            or (add_to is not None and add_to.dtype != x.dtype)):
        return int_swiglu_experts._init_fn(x, idx, gates, *[t for p in pairs for t in p], add_to)
    E, I, D = gate_s.shape[0], gate_s.shape[1], gate_s.shape[2] * GROUP
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < E):
        raise IndexError(f"an expert index of {idx.tolist()} is outside [0, {E})")
    x = x.contiguous()
    out = x.new_empty(x.shape) if add_to is None else add_to.clone(memory_format=torch.contiguous_format)
    idx, gates = idx.contiguous().long(), gates.contiguous().float()
    ak = dk.A_KIND[x.dtype]
    dk._load()[0].dsv3_swiglu_experts(
        gate_q.data_ptr(), up_q.data_ptr(), down_q.data_ptr(), gate_s.data_ptr(), up_s.data_ptr(), down_s.data_ptr(),
        KIND[bits_of(gate_q)], E, I, D, x.data_ptr(), ak, x.shape[0], idx.data_ptr(), gates.data_ptr(), idx.shape[1],
        out.data_ptr(), ak, int(add_to is not None), torch.get_num_threads())
    return out


@int_swiglu_experts.register_fake
def _int_swiglu_experts_fake(x, idx, gates, gate_q, gate_s, up_q, up_s, down_q, down_s, add_to=None):
    return torch.empty_like(x)


# ---- the modules ----------------------------------------------------------------------------------------------


class IntLinear(nn.Module):
    """A bias-free projection whose weight [N, K] is kept as integer groups (values and fp16 scales)."""

    def __init__(self, q: Tensor, scale: Tensor):
        super().__init__()
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.dsv3.int_linear(x, self.weight_q, self.weight_scale)

    def extra_repr(self) -> str:
        n, k = self.weight_scale.shape[0], self.weight_scale.shape[1] * GROUP
        return f"out_features={n}, in_features={k}, int{bits_of(self.weight_q)} groups of {GROUP}"


class IntWeight(dk.Weight):
    """An ``IntLinear``'s weight as the decode kernels read it (its own tensors, no copy): the values and the
    fp16 group scales, which the block kernel's linear layer takes as its ``scale``."""

    def __init__(self, q: Tensor, scale: Tensor):
        super().__init__(q, dtype=torch.float32)
        self.scale = self.kernel_scale = scale

    @property
    def kind(self) -> int | None:
        return KIND[bits_of(self.w)] if self.scale.dtype == torch.float16 and self.scale.is_contiguous() else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * GROUP

    def apply(self, x: Tensor) -> Tensor:
        return torch.ops.dsv3.int_linear(x, self.w, self.scale)

    def reference(self, x: Tensor) -> Tensor:
        return int_linear._init_fn(x, self.w, self.scale)

    def dense(self) -> Tensor:
        return dequantize(self.w, self.scale)


class IntExpertWeights:
    """Stacked integer experts as the decode step hands them to ``int_swiglu_experts``: (values, scales) of
    gate, up [E, I, D] and down [E, D, I]."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]):
        self.pairs = pairs

    def block_view(self) -> dict | None:
        """The block kernel's view of these experts (the fields of a descriptor's experts, as
        ``decode_kernels.block_experts`` gives for other kinds), or None when the kernels cannot read them."""
        (gq, gs), (uq, us), (dq, ds) = self.pairs
        tensors = [t for p in self.pairs for t in p]
        if (dk._load()[0] is None or len({q.dtype for q, _ in self.pairs}) != 1
                or not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
                or not all(s.dtype == torch.float16 for _, s in self.pairs)):
            return None
        E, I, D = gs.shape[0], gs.shape[1], gs.shape[2] * GROUP
        return {"gate": gq.data_ptr(), "up": uq.data_ptr(), "down": dq.data_ptr(), "gate_scale": gs.data_ptr(),
                "up_scale": us.data_ptr(), "down_scale": ds.data_ptr(), "kind": KIND[bits_of(gq)], "n_experts": E,
                "inter": I, "dim": D}

    def swiglu(self, x: Tensor, idx: Tensor, gates: Tensor, add_to: Tensor | None = None,
               use_kernel: bool = True) -> Tensor:
        args = (x, idx, gates, *[t for p in self.pairs for t in p], add_to)
        return torch.ops.dsv3.int_swiglu_experts(*args) if use_kernel else int_swiglu_experts._init_fn(*args)


def _rounded(x: Tensor) -> Tensor:
    """An expert projection's input as integer weights multiply it (``round_activations``), in x's dtype."""
    return round_activations(x).to(x.dtype)


class IntExperts(GroupedExperts):
    """Routed experts kept as integer groups; prefill dequantizes each routed-to expert when its rows run (the
    training kernel's per-expert loop), decode steps read them in place (``int_swiglu_experts``)."""

    def __init__(self, pairs: dict[str, tuple[Tensor, Tensor]], dtype: torch.dtype):
        nn.Module.__init__(self)
        for name in PROJECTIONS:
            self.register_buffer(name + "_q", pairs[name][0])
            self.register_buffer(name + "_scale", pairs[name][1])
        self.dtype = dtype

    @property
    def n_experts(self) -> int:
        return self.gate_proj_scale.shape[0]

    def pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(getattr(self, n + "_q"), getattr(self, n + "_scale")) for n in PROJECTIONS]

    def kernel_weights(self) -> IntExpertWeights:
        return IntExpertWeights(self.pairs())

    def forward(self, rows: ExpertRows) -> Tensor:
        return routed_forward(rows.x, rows.gates.to(rows.x.dtype), rows.token, rows.counts, self._weights,
                              inputs=_rounded)

    def _weights(self, e: int):
        return tuple(dequantize(q[e], s[e], self.dtype) for q, s in self.pairs())

    def fp8_training_form(self, scaling: str = "fine") -> None:
        return None

    def select(self, ids: Tensor) -> IntExperts:
        return IntExperts({n: (q[ids], s[ids]) for n, (q, s) in zip(PROJECTIONS, self.pairs(), strict=True)},
                          self.dtype)

    def extra_repr(self) -> str:
        e, i, d = self.n_experts, self.gate_proj_scale.shape[1], self.gate_proj_scale.shape[2] * GROUP
        return f"n_experts={e}, dim={d}, inter_dim={i}, int{bits_of(self.gate_proj_q)} groups of {GROUP}"


def shared_expert_weights(mlp: nn.Module) -> IntExpertWeights | None:
    """A dense SwiGLU MLP whose three projections are ``IntLinear`` as one integer expert, or None."""
    parts = [getattr(mlp, n, None) for n in PROJECTIONS]
    if type(mlp) is not MLP or not all(type(p) is IntLinear for p in parts) or mlp._forward_hooks:
        return None
    return IntExpertWeights([(p.weight_q.unsqueeze(0), p.weight_scale.unsqueeze(0)) for p in parts])


# ---- the swap -------------------------------------------------------------------------------------------------

Stored = dict[str, tuple[Tensor, Tensor]]  # checkpoint name "....weight" -> (values, scales) as stored


def to_int_weights(model: nn.Module, bits: int, stored: Stored | None = None,
                   held: list[int] | None = None) -> nn.Module:
    """Swap the weights ``int_bits`` names for integer groups: every MoE layer's routed experts for
    ``IntExperts``, each named linear layer (shared experts, dense MLPs, attention projections, the heads)
    for ``IntLinear``, at the width ``int_bits`` gives for ``bits`` (8 or 4): taken from ``stored`` (a
    checkpoint's integer weights, by checkpoint name) when it has them at that width, else quantized here.
    ``held``: the routed experts this model holds, in order (an expert-parallel rank's share), else all."""
    stored = stored or {}
    dtype = model.model.embed_tokens.weight.dtype
    for name, module in list(model.named_modules()):
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if type(experts) is not GroupedExperts:
            raise DSV3Error(f"{name}.experts is {type(experts).__name__}; integer weights start from plain experts")
        ids = held if held is not None else list(range(experts.n_experts))
        pairs = {proj: _stack([_pair(stored, f"{name}.experts.{e}.{proj}.weight", getattr(experts, proj)[i], bits)
                                for i, e in enumerate(ids)]) for proj in PROJECTIONS}
        module.experts = IntExperts(pairs, dtype)
    for name, module in list(model.named_modules()):
        width = int_bits(name + ".weight", bits)
        if width is not None and type(module) is nn.Linear and module.bias is None:
            parent, _, attr = name.rpartition(".")
            pair = _pair(stored, name + ".weight", module.weight, width)
            setattr(model.get_submodule(parent), attr, IntLinear(*pair))
    return model


def _pair(stored: Stored, key: str, w: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    got = stored.get(key)
    if got is not None and bits_of(got[0]) == bits:
        return got
    return quantize(w.detach(), bits)


def _stack(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
