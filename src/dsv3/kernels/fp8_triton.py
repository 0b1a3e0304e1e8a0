"""Our Triton FP8 GEMM: A [M, K] in 1x128 tiles times B [N, K] in 128x128 blocks (or 1x128 tiles), transposed,
with the V3 promotion: each 128-wide K chunk's ``tl.dot`` is scaled by its tile and block scales on the way into
one FP32 accumulator tile.

Triton ships with CUDA builds of torch; where it is missing (CPU installs) ``triton_blockwise`` is None and
``MISSING`` says why. On CUDA tensors the kernel is autotuned over four tile shapes. CPU tensors reach it only
under Triton's interpreter (``TRITON_INTERPRET=1`` before the first import: the tests), which has no GPU to tune
on and runs one tile shape.
"""

from __future__ import annotations

import torch

TILE = 128  # the K chunk: fp8.TILE (the kernel's loop below is written for it)
MISSING = None  # why the kernel cannot run here, or None

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    MISSING = "triton is not installed"

if triton is not None:

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

    _tuned_gemm = triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 3))
        ],
        key=["M", "N", "K"],
    )(_blockwise_fp8_gemm)

    INTERPRETER_TILE = {"BLOCK_M": 64, "BLOCK_N": 64}  # the one tile shape of CPU tensors (the interpreter)

    def triton_blockwise(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        """A [M, K] e4m3 with a_scale [M, K/128] times B [N, K] e4m3 with b_scale [N/128 or N, K/128], transposed:
        [M, N] in ``out_dtype``. Operands are checked by ``fp8.scaled_mm``."""
        a_q, b_q = a_q.contiguous(), b_q.contiguous()
        a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
        m, k = a_q.shape
        n = b_q.shape[0]
        out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
        b_rows_per_scale = 1 if b_scale.shape[0] == n else TILE

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        args = (a_q, b_q, out, a_scale, b_scale, m, n, k, a_scale.shape[1], b_rows_per_scale)
        if a_q.is_cuda:
            _tuned_gemm[grid](*args)
        else:
            _blockwise_fp8_gemm[grid](*args, **INTERPRETER_TILE)
        return out

else:
    triton_blockwise = None
