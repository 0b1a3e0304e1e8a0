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

import functools
import math
import os

import torch
import torch.nn.functional as F

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
    CUDA kernel (cuBLAS blockwise ``_scaled_mm``, then our Triton kernel) and otherwise
    ``dequantized``: one FP32 GEMM on the dequantized operands, the same sum as the chunked form up to
    FP32 rounding (there is no narrow accumulator to promote from on a CPU). ``chunked`` is the
    literal per-chunk reference (:func:`scaled_mm_chunked`).
    """
    if b_block not in ((TILE, TILE), (1, TILE)):
        raise DSV3Error(f"b_block must be (128, 128) or (1, 128), got {b_block!r}")
    _check_gemm_operands(a_q, a_scale, b_q, b_scale, b_block)
    choice = backend or os.environ.get("DSV3_FP8_GEMM", "auto")
    if choice not in GEMM_BACKENDS:
        raise DSV3Error(f"unknown FP8 GEMM backend {choice!r}; expected one of {GEMM_BACKENDS}")
    with torch.autocast(device_type=a_q.device.type, enabled=False):  # autocast would run the GEMM in BF16
        return _dispatch(choice, a_q, a_scale, b_q, b_scale, out_dtype, b_block)


def _dispatch(choice, a_q, a_scale, b_q, b_scale, out_dtype, b_block) -> torch.Tensor:
    if choice == "chunked":
        return scaled_mm_chunked(a_q, a_scale, b_q, b_scale, out_dtype, b_block)
    if a_q.is_cuda and choice != "dequantized":
        for name in _cuda_kernels(choice, a_q, b_q, b_block):
            try:
                return _CUDA_KERNELS[name](a_q, a_scale, b_q, b_scale, out_dtype)
            except RuntimeError as err:  # cuBLAS refuses some shapes its probe did not cover: try the next
                if choice != "auto":
                    raise DSV3Error(f"FP8 GEMM backend {name!r} failed on {tuple(a_q.shape)} x "
                                    f"{tuple(b_q.shape)}: {err}") from err  # fmt: skip
    if choice in ("torch", "triton"):
        raise DSV3Error(f"FP8 GEMM backend {choice!r} is not available for these operands on this device")
    a = dequantize(a_q, a_scale, (1, TILE))
    b = dequantize(b_q, b_scale, b_block)
    return (a @ b.t()).to(out_dtype)


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


# --------------------------------------------------------------------------------------------------
# CUDA paths, chosen at run time and validated once against the chunked reference
# --------------------------------------------------------------------------------------------------


def _cuda_kernels(choice: str, a_q: torch.Tensor, b_q: torch.Tensor, b_block: tuple[int, int]) -> list[str]:
    """The CUDA kernels among ``choice``'s candidates that fit the operands and passed their probe, in order."""
    if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn:
        return []  # the fast paths are validated for the V3 recipe (E4M3 everywhere) only
    device_index = a_q.device.index or 0
    names = ("torch", "triton") if choice == "auto" else (choice,)
    fits = {"torch": a_q.shape[1] % TILE == 0 and b_q.shape[0] % 16 == 0, "triton": True}
    return [name for name in names if fits[name] and cuda_backend_ok(name, b_block, device_index)]


# The tensor cores' FP8 products are summed in a narrow adder within each 128-wide chunk (about 13 fraction
# bits, measured by benchmarks/gpu_accumulation.py); only the chunk results are promoted to FP32. A probe
# therefore differs from the FP32 chunked reference by ~1e-4 normwise; a wrong scale layout by ~1.
CUDA_PROBE_TOLERANCE = 1e-3


def cuda_backend_ok(name: str, b_block: tuple[int, int] = (TILE, TILE), device_index: int = 0) -> bool:
    """Whether a CUDA candidate passed its probe GEMM (see :func:`probe_cuda_backend`)."""
    return probe_cuda_backend(name, b_block, device_index)[0]


@functools.cache
def probe_cuda_backend(name: str, b_block: tuple[int, int] = (TILE, TILE), device_index: int = 0) -> tuple[bool, str]:
    """Run a CUDA candidate once on a probe GEMM: (usable, why). It is used only if it agrees with the
    chunked reference within CUDA_PROBE_TOLERANCE."""
    if name == "triton" and triton is None:
        return False, "triton is not installed"
    gen = torch.Generator(device="cpu").manual_seed(0)
    device = torch.device("cuda", device_index)
    a_q, a_s = quantize(torch.randn(200, 640, generator=gen).to(device))
    b_q, b_s = quantize(torch.randn(384, 640, generator=gen).to(device), block=b_block)
    try:
        got = _CUDA_KERNELS[name](a_q, a_s, b_q, b_s, torch.float32)
    except Exception as err:  # the kernel or its scale layout is not supported by this torch/triton/GPU
        return False, f"{type(err).__name__}: {err}"[:300]
    want = scaled_mm_chunked(a_q, a_s, b_q, b_s, torch.float32, b_block)
    rel = float(torch.linalg.norm(got.float() - want) / torch.linalg.norm(want))
    return rel <= CUDA_PROBE_TOLERANCE, f"normwise difference from the chunked reference {rel:.2e}"


def _torch_blockwise(a_q, a_scale, b_q, b_scale, out_dtype):
    """cuBLAS blockwise FP8 GEMM (sm90, CUDA >= 12.9, K % 128 == 0) through ``F.scaled_mm`` with explicit
    recipes: torch 2.11's ``torch._scaled_mm`` no longer infers the blockwise recipes from scale shapes."""
    m = a_q.shape[0]
    if m == 0:
        return torch.empty(0, b_q.shape[0], dtype=out_dtype, device=a_q.device)
    pad = -m % 4  # the scales' leading dimension is M: cuBLAS wants it 16-byte aligned
    if pad:
        zeros = torch.zeros(pad, a_q.shape[1], dtype=torch.uint8, device=a_q.device)
        a_q = torch.cat([a_q.view(torch.uint8), zeros]).view(a_q.dtype)  # FP8 zero is all-zero bits
        a_scale = torch.cat([a_scale, a_scale.new_ones(pad, a_scale.shape[1])])
    sa = a_scale.float().t().contiguous().t()  # [M, K/128], outer-dim-major (stride (1, M))
    if b_scale.shape[0] == b_q.shape[0]:  # 1x128 tiles on B too: [N, K/128], outer-dim-major
        sb, recipe_b = b_scale.float().t().contiguous().t(), F.ScalingType.BlockWise1x128
    else:  # 128x128 blocks: [L4, N/128], the transpose of [N/128, K/128] with K blocks padded to 4
        kb = b_scale.shape[1]
        sb = F.pad(b_scale.float(), (0, -(-kb // 4) * 4 - kb)).t()
        recipe_b = F.ScalingType.BlockWise128x128
    out = F.scaled_mm(a_q.contiguous(), b_q.contiguous().t(), sa, F.ScalingType.BlockWise1x128, sb, recipe_b,
                      output_dtype=out_dtype)  # fmt: skip
    return out[:m]


def _triton_blockwise(a_q, a_scale, b_q, b_scale, out_dtype):
    """Our Triton kernel: one FP32 accumulator tile; each 128-wide K chunk's dot is scaled on the way in."""
    a_q, b_q = a_q.contiguous(), b_q.contiguous()
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    m, k = a_q.shape
    n = b_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    b_rows_per_scale = 1 if b_scale.shape[0] == n else TILE

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    _blockwise_fp8_gemm[grid](a_q, b_q, out, a_scale, b_scale, m, n, k, a_scale.shape[1], b_rows_per_scale)
    return out


_CUDA_KERNELS = {"torch": _torch_blockwise, "triton": _triton_blockwise}

try:  # Triton ships with CUDA builds of torch; CPU installs simply go without this kernel
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 3))
        ],
        key=["M", "N", "K"],
    )
    @triton.jit
    def _blockwise_fp8_gemm(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, KB, B_ROWS_PER_SCALE,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, 128)
        a_ptrs = a_ptr + rows[:, None] * K + ks[None, :]  # [BM, 128]
        b_ptrs = b_ptr + cols[None, :] * K + ks[:, None]  # [128, BN]: B is [N, K], read transposed
        as_ptrs = as_ptr + rows * KB
        bs_ptrs = bs_ptr + (cols // B_ROWS_PER_SCALE) * KB
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(KB):
            k_ok = ks < K - c * 128
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=(cols[None, :] < N) & k_ok[:, None], other=0.0)
            sa = tl.load(as_ptrs + c, mask=rows < M, other=0.0)
            sb = tl.load(bs_ptrs + c, mask=cols < N, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]  # the promotion: each chunk lands in FP32
            a_ptrs += 128
            b_ptrs += 128
        c_ptrs = c_ptr + rows[:, None] * N + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
