"""Grouped experts: the routed experts of one MoE layer, computing SwiGLU on the rows a token dispatcher
hands them (``ExpertRows``: rows plus (row, expert, gate) pairs grouped by expert), whatever moved them.

Three kinds share the stacked weights' names and shapes (gate_proj/up_proj [E, I, D], down_proj
[E, D, I]; checkpoints store them one module per expert, see checkpoint.py) and differ only in how the
weights enter the matmuls:

* ``GroupedExperts``: plain parameters, through the fused ``routed_swiglu`` autograd node (kernels.py).
* ``FP8Experts``: FP8 training GEMMs (V3's "experts included"): every projection of every expert runs
  ``fp8_linear`` with the V3 tiling, forward and backward, from the same FP32 master parameters.
* ``ResidentFP8Experts``: inference weights kept in DeepSeek's FP8 128x128 blocks, dequantized one
  routed-to expert at a time.

A new kind subclasses ``GroupedExperts`` and overrides ``forward(rows)`` (and ``select`` when its weights
are not the plain parameters); every dispatcher then feeds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv3.model.dispatch import ExpertRows
from dsv3.model.kernels import routed_forward, routed_swiglu
from dsv3.precision import fp8
from dsv3.precision.fp8_linear import check_scaling, fp8_linear, fp32_parameter

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked parameters, computed grouped: one matmul per expert over its slice of
    rows (no Python loop over tokens)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim))

    @property
    def n_experts(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, rows: ExpertRows) -> torch.Tensor:
        """rows -> out [R, D]: out[token] += gate * SwiGLU_e(x[token]) over the pairs of every expert e."""
        return routed_swiglu(rows.x, rows.gates, rows.token, rows.counts, self.gate_proj, self.up_proj,
                             self.down_proj)

    def fp8_training_form(self, scaling: str = "fine") -> nn.Module | None:
        """The same experts with FP8 GEMMs, sharing the parameters (``convert_to_fp8`` asks every module
        for its FP8 form; None: this one has none, or already is one)."""
        return FP8Experts.from_experts(self, scaling)

    def select(self, ids: torch.Tensor) -> GroupedExperts:
        """Experts of the same kind holding copies of experts ``ids`` only (an expert-parallel shard)."""
        e, inter, dim = self.gate_proj.shape
        part = GroupedExperts(ids.numel(), dim, inter).to(self.gate_proj)
        with torch.no_grad():
            for name in PROJECTIONS:
                getattr(part, name).copy_(getattr(self, name)[ids])
        return part

    def extra_repr(self) -> str:
        e, i, d = self.gate_proj.shape
        return f"n_experts={e}, dim={d}, inter_dim={i}"


class FP8Experts(GroupedExperts):
    """The routed experts with every projection an FP8 GEMM; same FP32 master parameters as
    :class:`GroupedExperts`, so checkpoints do not change."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, scaling: str = "fine") -> None:
        super().__init__(n_experts, dim, inter_dim)
        self.scaling = check_scaling(scaling)

    def forward(self, rows: ExpertRows) -> torch.Tensor:
        """As GroupedExperts, each expert's slice through three FP8 GEMMs; gates scale its output."""
        x, token = rows.x, rows.token
        xs = x[token]  # [S, D], grouped by expert
        stacked = (self.gate_proj, self.up_proj, self.down_proj)
        per_expert = zip(*(w.unbind(0) for w in stacked), strict=True)  # unbind once: one stack in backward
        outs = [self.expert_mlp(chunk, *w) for chunk, w in zip(xs.split(rows.counts), per_expert, strict=True)
                if len(chunk)]
        if not outs:  # nothing routed here: zeros that still depend on the rows and gates, so a dispatcher's
            return x * 0 + rows.gates.sum().to(x.dtype) * 0  # backward (a collective) runs on every rank
        ys = torch.cat(outs) * rows.gates[:, None].to(x.dtype)  # FP8 GEMMs return x's dtype
        return torch.zeros_like(x).index_add_(0, token, ys)

    def expert_mlp(self, chunk: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
        """SwiGLU of one expert on its chunk [n, D] with FP8 GEMMs; output in chunk's dtype."""
        gate = fp8_linear(chunk, w_gate, None, self.scaling)
        up = fp8_linear(chunk, w_up, None, self.scaling)
        return fp8_linear(F.silu(gate) * up, w_down, None, self.scaling)

    def fp8_training_form(self, scaling: str = "fine") -> None:
        return None

    def select(self, ids: torch.Tensor) -> FP8Experts:
        return FP8Experts.from_experts(super().select(ids), self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling}"

    @classmethod
    def from_experts(cls, experts: GroupedExperts, scaling: str = "fine") -> FP8Experts:
        """Wrap existing experts: the FP32 Parameters (and any forward hooks) are shared, not copied."""
        _, i, d = experts.gate_proj.shape
        module = cls(0, d, i, scaling=scaling)
        for name in PROJECTIONS:
            setattr(module, name, fp32_parameter(getattr(experts, name)))
        module._forward_hooks = experts._forward_hooks
        module._forward_pre_hooks = experts._forward_pre_hooks
        module.train(experts.training)
        return module


class FP8ExpertStack(nn.Module):
    """Stacked expert weights [E, N, K] in FP8 128x128 blocks; ``stack[e]`` dequantizes expert e only."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight_fp8", q)  # [E, N, K]
        self.register_buffer("weight_scale_inv", scale_inv.float())  # [E, N/128, K/128]
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight_fp8.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return fp8.dequantize_weight_blocks(self.weight_fp8[e], self.weight_scale_inv[e], self.dtype)


class ResidentFP8Experts(GroupedExperts):
    """Inference experts whose weights stay FP8 in memory (about half of BF16's bytes); each routed-to
    expert is dequantized when its rows run, through the same per-expert loop as training's kernel."""

    def __init__(self, stacks: dict[str, FP8ExpertStack]):
        nn.Module.__init__(self)
        for name in PROJECTIONS:
            self.add_module(name, stacks[name])

    @classmethod
    def from_experts(cls, experts: GroupedExperts, dtype: torch.dtype, stored=None) -> ResidentFP8Experts:
        """``stored(proj)`` gives a projection's (fp8 [E, N, K], scale_inv) when the checkpoint has it;
        otherwise the weights are quantized here."""
        stacks = {}
        for name in PROJECTIONS:
            q, s = (stored(name) if stored is not None else None) or fp8.quantize_weight_blocks(
                getattr(experts, name).detach())
            stacks[name] = FP8ExpertStack(q, s, dtype)
        return cls(stacks)

    def forward(self, rows: ExpertRows) -> torch.Tensor:
        return routed_forward(rows.x, rows.gates.to(rows.x.dtype), rows.token, rows.counts, self._weights)

    def _weights(self, e: int):
        return self.gate_proj[e], self.up_proj[e], self.down_proj[e]

    def fp8_training_form(self, scaling: str = "fine") -> None:
        return None

    def select(self, ids: torch.Tensor) -> ResidentFP8Experts:
        stacks = {name: FP8ExpertStack(getattr(self, name).weight_fp8[ids], getattr(self, name).weight_scale_inv[ids],
                                       getattr(self, name).dtype) for name in PROJECTIONS}
        return ResidentFP8Experts(stacks)

    def extra_repr(self) -> str:
        e, i, d = self.gate_proj.shape
        return f"n_experts={e}, dim={d}, inter_dim={i}, fp8 blocks"

