"""The CUDA kernels of ``torch.ops.dsv3.fp8_blockwise_mm`` (dsv3/kernels/fp8_gemm.py, fp8_triton.py), checked
without a GPU: our Triton kernel against the float64 product under Triton's interpreter (CPU tensors, FP8 e4m3
included), and the CUDA registration's choice of kernel (probe, operand fit, fallback, errors) with stand-in
kernels on CPU tensors. The kernels themselves on a GPU: benchmarks/gpu_fp8_gemm.py (gpu_check.sh)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.kernels import fp8_gemm
from dsv3.precision import fp8

# Run in a child: triton.jit reads TRITON_INTERPRET when the kernel is defined, at import.
INTERPRETED = """
import json, torch
from dsv3.kernels import fp8_gemm, fp8_triton
from dsv3.precision import fp8
rows = []
for b_block in ((128, 128), (1, 128)):
    for m, n, k in ((1, 16, 128), (70, 150, 300), (130, 64, 512)):
        gen = torch.Generator().manual_seed(m + n + k)
        a_q, a_s = fp8.quantize(torch.randn(m, k, generator=gen) * 3)
        b_q, b_s = fp8.quantize(torch.randn(n, k, generator=gen) * 0.05, block=b_block)
        got = fp8_triton.triton_blockwise(a_q, a_s, b_q, b_s, torch.float32)
        want = fp8.dequantize(a_q, a_s, (1, 128), torch.float64) @ fp8.dequantize(b_q, b_s, b_block, torch.float64).t()
        rel = float((got.double() - want).norm() / want.norm())
        rows.append({"b_block": b_block, "mnk": [m, n, k], "shape": list(got.shape), "rel": rel})
probe = {str(b): fp8_gemm.probe("triton", b, "cpu") for b in ((128, 128), (1, 128))}
print(json.dumps({"rows": rows, "probe": probe}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (CUDA builds of torch bring it; `pip install triton` here)")
def test_triton_kernel_matches_float64_under_the_interpreter():
    """Ragged M, N and K, one row, both scale layouts of B: the kernel's tiles, masks and per-chunk scales."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for row in report["rows"]:
        assert row["shape"] == row["mnk"][:2]
        assert row["rel"] <= 1e-6, row  # the interpreter's dot is FP32: only FP32 rounding is left
    for ok, why in report["probe"].values():
        assert ok and "normwise difference" in why


def operands(m=8, n=32, k=256, b_block=(128, 128), fmt="e4m3"):
    gen = torch.Generator().manual_seed(0)
    a_q, a_s = fp8.quantize(torch.randn(m, k, generator=gen), fmt=fmt)
    b_q, b_s = fp8.quantize(torch.randn(n, k, generator=gen), block=b_block, fmt=fmt)
    return a_q, a_s, b_q, b_s


def cuda_op(a_q, a_s, b_q, b_s, backend, b_rows=128):
    """The op's CUDA registration, called directly on CPU tensors (the dispatcher would send them elsewhere)."""
    return fp8_gemm.fp8_blockwise_mm_cuda(a_q, a_s, b_q, b_s, torch.float32, b_rows, backend)


@pytest.fixture
def stand_ins(monkeypatch):
    """Stand-in kernels that record their calls and return a marker value; every probe passes."""
    calls = []

    def kernel(name, fails=False):
        def run(a_q, a_s, b_q, b_s, out_dtype):
            calls.append(name)
            if fails:
                raise RuntimeError(f"{name} refuses this shape")
            return torch.full((a_q.shape[0], b_q.shape[0]), float(len(name)), dtype=out_dtype)
        return run

    def install(torch_fails=False, probe_ok=True):
        monkeypatch.setitem(fp8_gemm.KERNELS, "torch", kernel("torch", torch_fails))
        monkeypatch.setitem(fp8_gemm.KERNELS, "triton", kernel("triton"))
        monkeypatch.setattr(fp8_gemm, "probe", lambda name, b_block, device: (probe_ok, "stand-in probe"))
        return calls

    return install


def test_auto_takes_cublas_first_then_triton_then_the_reference(stand_ins):
    calls = stand_ins()
    assert cuda_op(*operands(), "auto").unique().tolist() == [5.0] and calls == ["torch"]
    calls.clear()
    assert cuda_op(*operands(k=300), "auto").unique().tolist() == [6.0] and calls == ["triton"]  # K % 128 != 0
    calls.clear()
    a_q, a_s, b_q, b_s = operands(fmt="e5m2")  # the fast paths are validated for E4M3 only: the reference
    got = cuda_op(a_q, a_s, b_q, b_s, "auto")
    assert calls == [] and torch.equal(got, fp8.scaled_mm(a_q, a_s, b_q, b_s, torch.float32, backend="dequantized"))


def test_auto_moves_on_when_cublas_refuses_a_shape(stand_ins):
    calls = stand_ins(torch_fails=True)
    assert cuda_op(*operands(), "auto").unique().tolist() == [6.0] and calls == ["torch", "triton"]


def test_a_named_kernel_that_cannot_run_is_one_clear_error(stand_ins):
    stand_ins(torch_fails=True)
    with pytest.raises(DSV3Error, match=r"'torch' cannot run \(8, 256\) x \(32, 256\).*refuses this shape"):
        cuda_op(*operands(), "torch")
    with pytest.raises(DSV3Error, match="K % 128 == 0"):
        cuda_op(*operands(k=300), "torch")
    stand_ins(probe_ok=False)
    with pytest.raises(DSV3Error, match="'triton' cannot run.*probe GEMM failed"):
        cuda_op(*operands(), "triton")


def test_reference_backends_pass_through_the_cuda_registration(stand_ins):
    calls = stand_ins()
    a_q, a_s, b_q, b_s = operands(b_block=(1, 128))
    for name in ("chunked", "dequantized"):
        want = fp8.scaled_mm(a_q, a_s, b_q, b_s, torch.float32, (1, 128), backend=name)
        assert torch.equal(cuda_op(a_q, a_s, b_q, b_s, name, b_rows=1), want)
    assert calls == []


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_probe_accepts_a_correct_kernel_and_rejects_a_wrong_scale_layout(monkeypatch, b_block):
    probe = fp8_gemm.probe.__wrapped__  # uncached: the stand-ins below are not the real kernels

    def right(a_q, a_s, b_q, b_s, out_dtype):
        return fp8.scaled_mm(a_q, a_s, b_q, b_s, out_dtype, b_block, backend="dequantized")

    def ignores_b_scales(a_q, a_s, b_q, b_s, out_dtype):
        return right(a_q, a_s, b_q, torch.ones_like(b_s), out_dtype)

    monkeypatch.setitem(fp8_gemm.KERNELS, "torch", right)
    assert probe("torch", b_block, "cpu")[0]
    monkeypatch.setitem(fp8_gemm.KERNELS, "torch", ignores_b_scales)
    ok, why = probe("torch", b_block, "cpu")
    assert not ok and float(why.split()[-1]) > 0.5
    monkeypatch.setitem(fp8_gemm.KERNELS, "torch", lambda *args: torch.zeros(1).view(2))
    ok, why = probe("torch", b_block, "cpu")
    assert not ok and why.startswith("RuntimeError")
