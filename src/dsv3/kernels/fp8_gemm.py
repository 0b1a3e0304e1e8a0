"""The CUDA kernels of ``torch.ops.dsv3.fp8_blockwise_mm`` (the promoted block-scaled FP8 GEMM that
``dsv3.precision.fp8`` defines with its PyTorch reference): cuBLAS blockwise FP8 through ``F.scaled_mm``
(backend ``torch``) and our Triton kernel (``triton``, ``fp8_triton``), registered for CUDA tensors on import.

Each kernel is used only after it agreed with the chunked reference on a probe GEMM (``probe``, once per
kernel, scale layout and device), and only for operands it takes (E4M3; cuBLAS also K % 128 == 0, N % 16 == 0).
``auto`` tries them in that order and falls back to the reference; a backend named explicitly that cannot run
is one clear error saying why.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsv3.errors import DSV3Error
from dsv3.kernels import fp8_triton
from dsv3.precision.fp8 import CUDA_BACKENDS, TILE, fp8_blockwise_mm_reference, quantize, scaled_mm_chunked

# The tensor cores' FP8 products are summed in a narrow adder within each 128-wide chunk (about 13 fraction
# bits, measured by benchmarks/gpu_accumulation.py); only the chunk results are promoted to FP32. A probe
# therefore differs from the FP32 chunked reference by ~1e-4 normwise; a wrong scale layout by ~1.
CUDA_PROBE_TOLERANCE = 1e-3


def torch_blockwise(a_q, a_scale, b_q, b_scale, out_dtype):
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


KERNELS = {"torch": torch_blockwise, "triton": fp8_triton.triton_blockwise}  # CUDA_BACKENDS, in auto's order


@functools.cache
def probe(name: str, b_block: tuple[int, int], device: str) -> tuple[bool, str]:
    """Run kernel ``name`` once on a probe GEMM on ``device`` (``str(tensor.device)``, e.g. "cuda:0"): (usable,
    why). It is usable only if it agrees with the chunked reference within CUDA_PROBE_TOLERANCE."""
    if name == "triton" and fp8_triton.MISSING:
        return False, fp8_triton.MISSING
    gen = torch.Generator(device="cpu").manual_seed(0)
    a_q, a_s = quantize(torch.randn(200, 640, generator=gen).to(device))
    b_q, b_s = quantize(torch.randn(384, 640, generator=gen).to(device), block=b_block)
    try:
        got = KERNELS[name](a_q, a_s, b_q, b_s, torch.float32)
    except Exception as err:  # the kernel or its scale layout is not supported by this torch/triton/GPU
        return False, f"{type(err).__name__}: {err}"[:300]
    want = scaled_mm_chunked(a_q, a_s, b_q, b_s, torch.float32, b_block)
    rel = float(torch.linalg.norm(got.float() - want) / torch.linalg.norm(want))
    return rel <= CUDA_PROBE_TOLERANCE, f"normwise difference from the chunked reference {rel:.2e}"


def refusal(name: str, a_q: torch.Tensor, b_q: torch.Tensor, b_block: tuple[int, int]) -> str | None:
    """Why kernel ``name`` does not take these operands (None: it does)."""
    if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn:
        return "it is validated for E4M3 operands only (the V3 recipe)"
    if name == "torch" and (a_q.shape[1] % TILE or b_q.shape[0] % 16):
        return f"cuBLAS needs K % 128 == 0 and N % 16 == 0, got K = {a_q.shape[1]}, N = {b_q.shape[0]}"
    ok, why = probe(name, b_block, str(a_q.device))
    return None if ok else f"its probe GEMM failed ({why})"


def fp8_blockwise_mm_cuda(a_q, a_scale, b_q, b_scale, out_dtype, b_block_rows, backend):
    """``auto``: the first kernel that takes the operands (a cuBLAS refusal of a shape its probe did not cover
    moves on to the next), else the reference; ``torch`` / ``triton``: that kernel or an error."""
    if backend not in ("auto", *CUDA_BACKENDS):
        return fp8_blockwise_mm_reference(a_q, a_scale, b_q, b_scale, out_dtype, b_block_rows, backend)
    b_block = (b_block_rows, TILE)
    for name in CUDA_BACKENDS if backend == "auto" else (backend,):
        why = refusal(name, a_q, b_q, b_block)
        if why is None:
            try:
                return KERNELS[name](a_q, a_scale, b_q, b_scale, out_dtype)
            except RuntimeError as err:
                why = f"{type(err).__name__}: {err}"[:300]
        if backend != "auto":
            raise DSV3Error(f"FP8 GEMM backend {name!r} cannot run {tuple(a_q.shape)} x {tuple(b_q.shape)} on "
                            f"{a_q.device}: {why}")
    return fp8_blockwise_mm_reference(a_q, a_scale, b_q, b_scale, out_dtype, b_block_rows, "dequantized")


torch.library.impl("dsv3::fp8_blockwise_mm", "cuda", fp8_blockwise_mm_cuda)
