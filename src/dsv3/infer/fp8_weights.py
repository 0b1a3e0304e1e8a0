"""Resident FP8 weights: projections kept as float8_e4m3fn plus one fp32 scale per 128x128 block (the
format DeepSeek ships), dequantized on the fly when a layer runs, so weight memory is about half of
BF16's. Routed experts are dequantized one expert at a time, only for the experts a step routes to.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsv3.checkpoint import FP8_BLOCK, checkpoint_files, fp8_quantizable, quantize_fp8_blocks, read_tensors

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [N, K] times its per-block scale [ceil(N/128), ceil(K/128)] -> dtype [N, K]."""
    n, k = q.shape
    b = FP8_BLOCK
    if n % b == 0 and k % b == 0:  # whole blocks: broadcast the scales, no expanded copy
        return (q.view(n // b, b, k // b, b).float() * scale_inv[:, None, :, None]).view(n, k).to(dtype)
    scale = scale_inv.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    return (q.float() * scale).to(dtype)


class FP8BlockLinear(nn.Module):
    """A bias-free nn.Linear whose weight lives in FP8 blocks; ``weight`` dequantizes on access."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale_inv", scale_inv.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.weight_fp8, self.weight_scale_inv, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FP8ExpertStack(nn.Module):
    """Stacked expert weights [E, N, K] in FP8; ``stack[e]`` dequantizes expert e only. It stands in for
    the ``Experts`` Parameters, whose forward indexes one expert at a time."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight_fp8", q)  # [E, N, K]
        self.register_buffer("weight_scale_inv", scale_inv.float())  # [E, N/128, K/128]
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight_fp8.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize(self.weight_fp8[e], self.weight_scale_inv[e], self.dtype)


def stored_fp8(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The FP8 weights of a checkpoint exactly as stored: name -> (fp8 weight, scale_inv)."""
    tensors = dict(read_tensors(checkpoint_files(Path(path))))
    return {name: (t, tensors[name + "_scale_inv"]) for name, t in tensors.items()
            if t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in tensors}


def to_fp8_weights(model: nn.Module, stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
    """Swap every FP8-quantizable projection (DeepSeek's choice: attention and FFN matrices, experts
    included) for its FP8 form, taken from ``stored`` when the checkpoint has it, else quantized here."""
    stored = stored or {}
    dtype = model.model.embed_tokens.weight.dtype
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and fp8_quantizable(name + ".weight", module.weight):
            q, s = stored.get(name + ".weight") or quantize_fp8_blocks(module.weight.detach())
            _replace(model, name, FP8BlockLinear(q, s, dtype, module.bias))
        elif type(module).__name__ == "Experts":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                q, s = _expert_stack(name, proj, getattr(module, proj).detach(), stored)
                delattr(module, proj)
                module.add_module(proj, FP8ExpertStack(q, s, dtype))
    return model


def _expert_stack(prefix: str, proj: str, stacked: torch.Tensor, stored) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [stored.get(f"{prefix}.{e}.{proj}.weight") or quantize_fp8_blocks(stacked[e])
             for e in range(stacked.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def resident_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (shared storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
