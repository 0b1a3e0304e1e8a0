"""Fine-grained FP8 quantization and the promoted block-scaled GEMM of the DeepSeek-V3 recipe.

Activations are scaled per 1x128 tile along the GEMM's inner dimension K, weights per 128x128 block,
and the backward pass re-tiles activations as 128x1. A scale is ``amax / fmt_max`` computed online
(amax clamped at 1e-4, optionally rounded up to a power of two: UE8M0). The GEMM multiplies each
128-wide K chunk, scales it by its tile and block scales and accumulates the chunks in FP32: the
"promotion" that keeps Hopper's limited-precision tensor-core accumulator from losing accuracy.

Scale shapes: ``x: [..., R, C]`` quantized with ``block=(br, bc)`` has ``scale: [..., ceil(R/br),
ceil(C/bc)]`` (float32). Ragged edges are padded with zeros for the amax, which never changes it.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from dsv3.errors import DSV3Error

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant clamps amax here so all-zero tiles get a finite scale
TILE = 128
GEMM_BACKENDS = ("auto", "torch", "triton", "chunked", "dequantized")


def fmt_max(fmt: str) -> float:
    """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(_dtype(fmt)).max)


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise DSV3Error(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scale tensor for a tensor of ``shape`` quantized in ``block`` tiles (ceil-div)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad the last two dims to whole blocks and view as [..., Rb, br, Cb, bc]."""
    br, bc = block
    *lead, rows, cols = x.shape
    pad_r, pad_c = (-rows) % br, (-cols) % bc
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(*lead, (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Broadcast a per-block scale back to element shape ``shape`` (cropping ragged edges)."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., : shape[-2], : shape[-1]]


def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Round positive scales up to the next power of two (UE8M0 scales): 2**ceil(log2 s)."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def quantize(
    x: torch.Tensor, block: tuple[int, int] = (1, TILE), fmt: str = "e4m3", pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x: [..., R, C]`` to FP8 with one online scale per ``block`` tile of the last two dims.

    Returns ``(q, scale)`` with ``q`` the FP8 tensor of ``x``'s shape and ``scale`` float32 of
    :func:`scale_shape`, such that ``x ~= q * scale`` (scale is the *dequantization* factor).
    """
    if x.dim() < 2:
        raise DSV3Error(f"quantize needs a tensor with at least 2 dims, got shape {tuple(x.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise DSV3Error(f"block must be two positive ints, got {block!r}")
    dtype, top = _dtype(fmt), fmt_max(fmt)
    x32 = x.float()
    amax = _blocked(x32, block).abs().amax(dim=(-3, -1))  # [..., Rb, Cb]
    scale = amax.clamp(min=AMAX_FLOOR) / top
    if pow2_scale:
        scale = pow2_ceil(scale)
    q = (x32 / _expand(scale, block, x.shape)).to(dtype)
    return q, scale


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (1, TILE),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``q * scale`` broadcast over each block, in ``dtype``."""
    if tuple(scale.shape) != scale_shape(q.shape, block):
        raise DSV3Error(
            f"scale shape {tuple(scale.shape)} does not match {tuple(q.shape)} in {block} blocks "
            f"(expected {scale_shape(q.shape, block)})"
        )
    *lead, rows, cols = q.shape
    if rows % block[0] == 0 and cols % block[1] == 0:  # whole blocks: broadcast the scales, no expanded copy
        blocks = q.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1]).float()
        return (blocks * scale.float()[..., :, None, :, None]).reshape(q.shape).to(dtype)
    return (q.float() * _expand(scale.float(), block, q.shape)).to(dtype)


# --------------------------------------------------------------------------------------------------
# DeepSeek's checkpoint format: 128x128 weight blocks with ``weight_scale_inv``
# --------------------------------------------------------------------------------------------------

WEIGHT_BLOCK = (TILE, TILE)
CHECKPOINT_SCALE_FLOOR = 1e-12  # DeepSeek's weight_scale_inv of an all-zero block


def quantize_weight_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [..., N, K] -> (float8_e4m3fn [..., N, K], float32 ``weight_scale_inv`` [..., ceil(N/128),
    ceil(K/128)]), the layout DeepSeek ships: scale_inv = amax / 448 of each block (edges zero-padded),
    values clamped to the E4M3 range. The one implementation of the format: checkpoints, conversion and
    inference's resident FP8 weights all call it."""
    top = fmt_max("e4m3")
    *lead, rows, cols = weight.shape
    blocks = _blocked(weight.float(), WEIGHT_BLOCK)  # [..., Nb, 128, Kb, 128]
    scale_inv = (blocks.abs().amax(dim=(-3, -1)) / top).clamp(min=CHECKPOINT_SCALE_FLOOR)
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-top, top).to(torch.float8_e4m3fn)
    padded = q.reshape(*lead, blocks.shape[-4] * TILE, blocks.shape[-2] * TILE)
    return padded[..., :rows, :cols].contiguous(), scale_inv


def dequantize_weight_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 weight [..., N, K] times its ``weight_scale_inv`` per 128x128 block -> ``dtype`` (exact in fp32).
    A scale of another shape is refused: it would broadcast into nonsense."""
    *lead, rows, cols = q.shape
    expected = (*lead, -(-rows // TILE), -(-cols // TILE))
    if tuple(scale_inv.shape) != expected:
        raise DSV3Error(f"an FP8 weight of shape {tuple(q.shape)} needs a weight_scale_inv of shape "
                        f"{expected}, got {tuple(scale_inv.shape)}")
    return dequantize(q, scale_inv, WEIGHT_BLOCK, dtype)


def quantize_per_tensor(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Coarse baseline: one scale for the whole tensor (what fine-grained scaling improves on)."""
    q, scale = quantize(x.reshape(1, -1), block=(1, x.numel()), fmt=fmt)
    return q.reshape(x.shape), scale.reshape(())


# --------------------------------------------------------------------------------------------------
# The promoted block-scaled GEMM
# --------------------------------------------------------------------------------------------------


def _check_gemm_operands(a_q, a_scale, b_q, b_scale, b_block) -> None:
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise DSV3Error(f"scaled_mm needs A [M, K] and B [N, K], got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if tuple(a_scale.shape) != scale_shape(a_q.shape, (1, TILE)):
        raise DSV3Error(
            f"a_scale {tuple(a_scale.shape)} is not A's 1x128 tile scale {scale_shape(a_q.shape, (1, TILE))}"
        )
    if tuple(b_scale.shape) != scale_shape(b_q.shape, b_block):
        raise DSV3Error(f"b_scale {tuple(b_scale.shape)} is not B's {b_block} scale {scale_shape(b_q.shape, b_block)}")


def scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    b_block: tuple[int, int] = (TILE, TILE),
    backend: str | None = None,
) -> torch.Tensor:
    """``A @ B.T`` for FP8 ``A: [M, K]`` in 1x128 tiles and ``B: [N, K]`` in ``b_block`` (128x128 or 1x128).

    Each 128-wide K chunk is multiplied, scaled by ``a_scale[m, c] * b_scale[n-block, c]`` and
    accumulated in FP32. ``backend`` (or env ``DSV3_FP8_GEMM``): ``auto`` picks the fastest validated
    CUDA kernel (cuBLAS blockwise, then our Triton kernel; both registered by ``dsv3.kernels``) and
    otherwise ``dequantized``: one FP32 GEMM on the dequantized operands, the same sum as the chunked
    form up to FP32 rounding (there is no narrow accumulator to promote from on a CPU). ``chunked`` is
    the literal per-chunk reference (:func:`scaled_mm_chunked`). The work is one op,
    ``torch.ops.dsv3.fp8_blockwise_mm`` (:func:`fp8_blockwise_mm_reference`).
    """
    if b_block not in ((TILE, TILE), (1, TILE)):
        raise DSV3Error(f"b_block must be (128, 128) or (1, 128), got {b_block!r}")
    _check_gemm_operands(a_q, a_scale, b_q, b_scale, b_block)
    choice = backend or os.environ.get("DSV3_FP8_GEMM", "auto")
    if choice not in GEMM_BACKENDS:
        raise DSV3Error(f"unknown FP8 GEMM backend {choice!r}; expected one of {GEMM_BACKENDS}")
    with torch.autocast(device_type=a_q.device.type, enabled=False):  # autocast would run the GEMM in BF16
        return fp8_blockwise_mm(a_q, a_scale, b_q, b_scale, out_dtype, b_block[0], choice)


CUDA_BACKENDS = ("torch", "triton")  # the kernels dsv3.kernels.fp8_gemm registers for CUDA tensors

# A plain torch.library op (define, impl, fake) rather than a torch.library.custom_op like the decode ops: an FP8
# training step calls it hundreds of times (three GEMMs per linear and expert), and custom_op's Python wrappers
# (an autograd layer, a dynamo guard) cost several times the dispatcher's own few microseconds a call on a CPU.
torch.library.define(
    "dsv3::fp8_blockwise_mm",
    "(Tensor a_q, Tensor a_scale, Tensor b_q, Tensor b_scale, ScalarType out_dtype, int b_block_rows, str backend)"
    " -> Tensor",
)


def fp8_blockwise_mm_reference(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                               b_block_rows: int, backend: str) -> Tensor:
    """The op behind :func:`scaled_mm` (operands checked there): A [M, K] FP8 with a_scale [M, K/128] times
    B [N, K] FP8 with b_scale [N / b_block_rows, K/128] (b_block_rows 1 or 128), transposed. This is its
    PyTorch reference, the op on every device: ``chunked`` or, for ``auto`` and ``dequantized``, one FP32
    GEMM of the dequantized operands. ``dsv3.kernels.fp8_gemm`` registers the CUDA kernel (cuBLAS and
    Triton behind ``auto``, ``torch`` and ``triton``); without it those two names are refused."""
    b_block = (b_block_rows, TILE)
    if backend == "chunked":
        return scaled_mm_chunked(a_q, a_scale, b_q, b_scale, out_dtype, b_block)
    if backend in CUDA_BACKENDS:
        where = ("its CUDA kernels are registered by importing dsv3.kernels, which this process has not done"
                 if a_q.is_cuda else f"it is a CUDA kernel and these operands are on {a_q.device.type}")
        raise DSV3Error(f"FP8 GEMM backend {backend!r} is not available: {where}")
    a = dequantize(a_q, a_scale, (1, TILE))
    b = dequantize(b_q, b_scale, b_block)
    return (a @ b.t()).to(out_dtype)


torch.library.impl("dsv3::fp8_blockwise_mm", "default", fp8_blockwise_mm_reference)


@torch.library.register_fake("dsv3::fp8_blockwise_mm")
def _fp8_blockwise_mm_fake(a_q, a_scale, b_q, b_scale, out_dtype, b_block_rows, backend):
    return a_q.new_empty(a_q.shape[0], b_q.shape[0], dtype=out_dtype)


fp8_blockwise_mm = torch.ops.dsv3.fp8_blockwise_mm.default


def _chunked(q: torch.Tensor, kb: int) -> torch.Tensor:
    """[R, K] FP8 -> [kb, R, 128] float32, zero-padding K (exact: FP8 values are exact in FP32)."""
    x = q.float()
    pad = kb * TILE - x.shape[1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[0], kb, TILE).transpose(0, 1)


def scaled_mm_chunked(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    b_block: tuple[int, int] = (TILE, TILE),
    max_bytes: int = 64 << 20,
) -> torch.Tensor:
    """The promotion written out: per-chunk FP32 products, scaled, accumulated in FP32 (any device).

    Chunks are processed in groups sized so that the [G, M, N] partial products stay under
    ``max_bytes``; the work is one batched matmul per group.
    """
    m, n = a_q.shape[0], b_q.shape[0]
    kb = a_scale.shape[1]
    a_chunks, b_chunks = _chunked(a_q, kb), _chunked(b_q, kb)  # [kb, M, 128], [kb, N, 128]
    b_rows = b_scale.float() if b_block[0] == 1 else b_scale.float().repeat_interleave(TILE, dim=0)[:n]
    a_s, b_s = a_scale.float().t(), b_rows.t()  # [kb, M], [kb, N]
    out = torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
    group = max(1, min(kb, max_bytes // max(1, 4 * m * n)))
    for start in range(0, kb, group):
        sl = slice(start, start + group)
        partial = torch.bmm(a_chunks[sl], b_chunks[sl].transpose(1, 2))  # [G, M, N], exact-ish FP32
        partial *= a_s[sl, :, None] * b_s[sl, None, :]
        out += partial.sum(dim=0)
    return out.to(out_dtype)
