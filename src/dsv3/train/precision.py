"""Numerics of a training run: autocast for bf16, FP8 linears for fp8, and the simulated low-precision
MoE combine (``--moe-output-format``), all applied to a built model before the optimizer sees it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsv3.errors import DSV3Error


def autocast(precision: str, device: torch.device):
    """bf16 and fp8 run the non-FP8 ops under bf16 autocast; fp32 runs plain."""
    if precision in ("bf16", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def keep_high_precision(name: str) -> bool:
    """The V3 recipe keeps the output head (and the MTP modules' copies) out of FP8; the embedding and
    the router gate are not nn.Linear, so they are never converted."""
    return name == "lm_head" or name.endswith("shared_head.head")


def apply_fp8(model: nn.Module) -> list[str]:
    """Swap the model's nn.Linear layers for FP8Linear and its routed experts for FP8Experts (V3's
    fine-grained recipe); the output head stays high precision. Importing ``dsv3.kernels`` registers the
    CUDA FP8 GEMMs (cuBLAS, Triton) that the FP8 layers pick on a GPU."""
    import dsv3.kernels  # noqa: F401
    from dsv3.precision.fp8_linear import convert_to_fp8

    return convert_to_fp8(model, skip=keep_high_precision)


def apply_moe_output_format(model: nn.Module, fmt: str) -> int:
    """Round-trip each MoE layer's routed output through ``fmt`` (straight-through in backward), as the
    combine all-to-all would deliver it; returns how many MoE layers simulate it."""
    from dsv3.model.dispatch import LocalDispatcher
    from dsv3.precision.logfmt import COMBINE_FORMATS

    if fmt not in COMBINE_FORMATS:
        raise DSV3Error(f"--moe-output-format must be one of {', '.join(COMBINE_FORMATS)}, got {fmt!r}")
    dispatchers = [m for m in model.modules() if isinstance(m, LocalDispatcher)]
    for d in dispatchers:
        d.combine_format = fmt
    return len(dispatchers)
