"""Symmetric group-wise integer weights for local deployment (llama.cpp's Q8_0 and Q4_0 in spirit).

A weight [..., N, K] (K a multiple of 32) is cut along K into groups of 32 values; each group keeps one
fp16 scale ``d`` and 32 integers ``q``, and stands for ``d * q``:

* int8: ``d = amax / 127``, ``q = round(w / d)`` in [-127, 127], stored as int8 [..., N, K] (8.5 bits a value
  with the scale);
* int4: ``d = m / -8`` where ``m`` is the group's value of largest magnitude (so it becomes exactly -8 and the
  range [-8, 7] is used whole), ``q = round(w / d)`` clamped to [-8, 7], stored as uint8 [..., N, K/2]: byte j
  of a group holds ``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its high one (4.5 bits a value).

Scales are fp16 [..., N, K/32]. The dtype tells the widths apart (int8 or uint8), so a stored pair is
self-describing. ``d * q`` is exact in fp32 (an 11-bit significand times at most 8 bits), which is how a
checkpoint's integer weights are read back into a float model before they are taken as stored.

A matrix product with such a weight multiplies it by activations rounded the same way, to int8 per group of
32 with an fp32 scale (``round_activations``, llama.cpp's Q8_0 rounding of the activations its Q8_0 and Q4_0
dot products take): the CPU kernels' byte products need it, and every other path applies it too, so that a
model's integer layers compute the same numbers wherever they run.
"""

from __future__ import annotations

import re

import torch

from dsv3.errors import DSV3Error

GROUP = 32
BITS = {"int8": 8, "int4": 4}
SCALE_SUFFIX = "_group_scale"  # a stored integer weight "W.weight" has its scales in "W.weight_group_scale"
STORED_DTYPES = {8: torch.int8, 4: torch.uint8}


_INT_AT_WIDTH = re.compile(r"\.mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj)\.weight$"
                           r"|\.self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|o_proj)\.weight$")
_INT_AT_8 = re.compile(r"^lm_head\.weight$|\.shared_head\.head\.weight$")


def int_bits(name: str, bits: int) -> int | None:
    """The width at which ``--weights int8|int4`` and ``convert --to int8|int4`` (``bits``) keep a weight as
    integer groups, or None for a weight they leave in its dtype. At ``bits``: every projection a decode step
    reads as a matrix (the routed and shared experts, the dense layers' MLPs, attention's query, latent and
    output projections). The output heads at 8 bits at either width, as llama.cpp keeps its output matrix
    at 6 or 8 bits in 4-bit files: the logits are what sampling reads. Left as they are: ``kv_b_proj``
    (read as per-head matrices by the absorbed attention), the MTP layer's ``eh_proj``, the routers, the
    norms and the embedding."""
    if _INT_AT_WIDTH.search(name):
        return bits
    return 8 if _INT_AT_8.search(name) else None


def bits_of(q: torch.Tensor) -> int:
    """8 for int8 values, 4 for packed int4 (uint8 bytes); DSV3Error for any other dtype."""
    for bits, dtype in STORED_DTYPES.items():
        if q.dtype == dtype:
            return bits
    raise DSV3Error(f"integer weights are int8 or uint8 (packed int4), not {q.dtype}")


def logical_shape(stored: tuple[int, ...], bits: int) -> tuple[int, ...]:
    """The weight's own shape from its stored one (int4 packs two values a byte along K)."""
    return (*stored[:-1], stored[-1] * 2) if bits == 4 else tuple(stored)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // GROUP)


def check_groupable(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) < 2 or shape[-1] % GROUP:
        raise DSV3Error(f"{name} {list(shape)} cannot take integer weights: its last dimension is not a "
                        f"multiple of {GROUP}")


def quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored values, fp16 scales) of ``w`` [..., N, K]; see the module docstring for the layout."""
    check_groupable("weight", tuple(w.shape))
    groups = w.detach().float().unflatten(-1, (-1, GROUP))
    if bits == 8:
        d = groups.abs().amax(-1) / 127
    elif bits == 4:
        top = groups.abs().argmax(-1, keepdim=True)
        d = groups.gather(-1, top).squeeze(-1) / -8
    else:
        raise DSV3Error(f"integer weights are 8 or 4 bits, not {bits}")
    d = d.half()  # quantize against the scale as stored, so d * q is what the weight will be read as
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    lo = -127 if bits == 8 else -8
    q = (groups * inv[..., None]).round().clamp(lo, 127 if bits == 8 else 7).to(torch.int8)
    return (q.flatten(-2) if bits == 8 else _pack4(q)), d


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., G, 32] in [-8, 7] -> uint8 [..., G * 16]: low nibble value j, high nibble value j + 16."""
    u = (q + 8).to(torch.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).flatten(-2)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 [..., K/32, 32] in [-8, 7]."""
    b = packed.unflatten(-1, (-1, GROUP // 2))
    return torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.int8) - 8


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [..., N, K] a stored pair stands for, computed in fp32 (exact) and cast to ``dtype``."""
    values = q.unflatten(-1, (-1, GROUP)) if bits_of(q) == 8 else _unpack4(q)
    return (values.float() * scale.float()[..., None]).flatten(-2).to(dtype)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] in fp32 as an integer layer multiplies it: each group of 32 values rounded to the nearest
    multiple of its largest magnitude / 127 (ties to even, as the CPU rounds), computed as the kernels do."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    top = groups.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: ``127.0 / top`` is computed as 127 * (1 / top), which rounds differently
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    return (torch.round(groups * inv) * (top / 127.0)).flatten(-2)


def bytes_per_value(bits: int) -> float:
    """Stored bytes per weight value, the scale included (int8 1.0625, int4 0.5625)."""
    return (GROUP * bits / 8 + 2) / GROUP
