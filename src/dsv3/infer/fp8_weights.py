"""Resident FP8 weights: projections kept as float8_e4m3fn plus one fp32 scale per 128x128 block (the
format DeepSeek ships), dequantized on the fly when a layer runs, so weight memory is about half of
BF16's. Routed experts become ``ResidentFP8Experts`` (model/experts.py), dequantized one expert at a time,
only for the experts a step routes to.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dsv3.checkpoint import checkpoint_files, fp8_quantizable, read_tensors
from dsv3.model.experts import FP8ExpertStack, GroupedExperts, ResidentFP8Experts
from dsv3.precision.fp8 import quantize_weight_blocks
from dsv3.precision.fp8_linear import FP8BlockLinear  # with the FP8 formats, below the model that reads it

__all__ = ["FP8BlockLinear", "FP8ExpertStack", "resident_bytes", "stored_fp8", "to_fp8_weights"]

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
            q, s = stored.get(name + ".weight") or quantize_weight_blocks(module.weight.detach())
            _replace(model, name, FP8BlockLinear(q, s, dtype, module.bias))
        elif type(module) is GroupedExperts:
            def from_checkpoint(proj, prefix=name, experts=module):
                return _expert_stack(prefix, proj, getattr(experts, proj).detach(), stored)

            _replace(model, name, ResidentFP8Experts.from_experts(module, dtype, from_checkpoint))
    return model


def _expert_stack(prefix: str, proj: str, stacked: torch.Tensor, stored) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [stored.get(f"{prefix}.{e}.{proj}.weight") or quantize_weight_blocks(stacked[e])
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
