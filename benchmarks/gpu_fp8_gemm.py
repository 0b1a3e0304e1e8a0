"""CUDA checks of the fine-grained FP8 GEMM: correctness against the CPU reference, then TFLOPS vs BF16.

Prints one JSON object per line. Run by benchmarks/gpu_check.sh on a lent GPU; exits 0 with a
"skipped" line where there is no CUDA device, and 1 when a correctness check fails.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dsv3.kernels import fp8_gemm  # registers the CUDA kernels of torch.ops.dsv3.fp8_blockwise_mm
from dsv3.precision import fp8
from dsv3.precision.fp8_linear import fp8_linear

BENCH_SHAPES = [(4096, 7168, 7168), (4096, 2048, 7168), (128, 7168, 2048)]
CHECK_SHAPES = [(256, 512, 1024), (200, 384, 640), (1024, 2048, 7168), (31, 384, 256), (1, 512, 128)]
KERNELS = ("torch", "triton", "dequantized")


def emit(**fields) -> None:
    print(json.dumps({"check": "fp8_gemm", **fields}), flush=True)


def bench_ms(fn) -> float:
    """Median milliseconds per call: triton's do_bench when present, else CUDA events over 50 calls."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    except ImportError:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50


def operands(m, n, k, b_block, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a_q, a_s = fp8.quantize(torch.randn(m, k, generator=gen).to(device))
    b_q, b_s = fp8.quantize((torch.randn(n, k, generator=gen) * 0.05).to(device), block=b_block)
    return a_q, a_s, b_q, b_s


def check_correctness(available: list[str]) -> bool:
    """Every kernel on CUDA against float64 on the CPU-dequantized operands (1e-5 relative, FP32 out)."""
    ok = True
    for b_block in ((128, 128), (1, 128)):
        for m, n, k in CHECK_SHAPES:
            a_q, a_s, b_q, b_s = operands(m, n, k, b_block, "cuda")
            ref = (
                fp8.dequantize(a_q.cpu(), a_s.cpu(), (1, 128), torch.float64)
                @ fp8.dequantize(b_q.cpu(), b_s.cpu(), b_block, torch.float64).t()
            )
            cpu = fp8.scaled_mm(a_q.cpu(), a_s.cpu(), b_q.cpu(), b_s.cpu(), torch.float32, b_block)
            for name in available:
                why = fp8_gemm.refusal(name, a_q, b_q, b_block) if name in fp8.CUDA_BACKENDS else None
                if why:  # e.g. cuBLAS and a K that is not a multiple of 128
                    emit(kind="correctness_skipped", backend=name, b_block=list(b_block), mnk=[m, n, k], why=why)
                    continue
                got = fp8.scaled_mm(a_q, a_s, b_q, b_s, torch.float32, b_block, backend=name).cpu().double()
                rel = float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))
                rel_cpu = float(torch.linalg.norm(got - cpu.double()) / torch.linalg.norm(ref))
                # the CUDA kernels sum each 128-chunk in the tensor cores' narrow FP8 adder (see fp8_gemm.py)
                passed = rel <= (fp8_gemm.CUDA_PROBE_TOLERANCE if name in fp8.CUDA_BACKENDS else 1e-5)
                ok &= passed
                emit(kind="correctness", backend=name, b_block=list(b_block), mnk=[m, n, k],
                     rel_err_vs_float64=rel, rel_diff_vs_cpu=rel_cpu, passed=passed)  # fmt: skip
    return ok


def check_fp8_linear() -> bool:
    """FP8Linear forward and both gradients on CUDA against the same computation on the CPU."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1024, generator=gen).bfloat16()
    w = torch.randn(768, 1024, generator=gen) / 32
    dy = torch.randn(512, 768, generator=gen).bfloat16()
    results = {}
    for device in ("cpu", "cuda"):
        xd = x.to(device).detach().requires_grad_(True)  # a fresh leaf per device (.to is a no-op on the CPU)
        wd = w.to(device).detach().requires_grad_(True)
        y = fp8_linear(xd, wd)
        y.backward(dy.to(device))
        results[device] = [t.detach().float().cpu() for t in (y, xd.grad, wd.grad)]
    ok = True
    for name, cpu, gpu in zip(("y", "grad_x", "grad_w"), results["cpu"], results["cuda"], strict=True):
        rel = float(torch.linalg.norm(gpu - cpu) / torch.linalg.norm(cpu))
        passed = rel < 1e-2  # BF16 rounding of outputs and summation order differ; quantization is identical
        ok &= passed
        emit(kind="fp8_linear", tensor=name, rel_diff_cuda_vs_cpu=rel, passed=passed)
    return ok


def benchmark(available: list[str]) -> None:
    """TFLOPS of BF16 matmul, per-tensor FP8 _scaled_mm (the hardware's peer) and each blockwise kernel."""
    for m, n, k in BENCH_SHAPES:
        bench_shape(m, n, k, available)


def bench_shape(m: int, n: int, k: int, available: list[str]) -> None:
    flops = 2 * m * n * k
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a_q, a_s, b_q, b_s = operands(m, n, k, (128, 128), "cuda")
    one = torch.ones((), device="cuda")
    runs = {
        "bf16_matmul": lambda: a @ b.t(),
        "fp8_tensorwise_scaled_mm": lambda: torch._scaled_mm(
            a_q, b_q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
    }
    for name in available:
        runs[f"fp8_blockwise_{name}"] = lambda name=name: fp8.scaled_mm(a_q, a_s, b_q, b_s, backend=name)
    for label, fn in runs.items():
        try:
            ms = bench_ms(fn)
        except Exception as exc:  # report and carry on: one missing kernel must not hide the rest
            emit(kind="speed", op=label, mnk=[m, n, k], error=f"{type(exc).__name__}: {exc}"[:300])
            continue
        emit(kind="speed", op=label, mnk=[m, n, k], ms=ms, tflops=flops / (ms / 1e3) / 1e12)
    ms = bench_ms(lambda: fp8.quantize(a))
    gbytes = a.numel() * (2 + 1) / 1e9  # read BF16, write FP8 (scales are 1/32 of that)
    emit(kind="speed", op="fp8_quantize_1x128", mk=[m, k], ms=ms, gb_per_s=gbytes / (ms / 1e3))


def main() -> int:
    if not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    started = time.time()
    emit(kind="device", name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
         torch=torch.__version__, cuda=torch.version.cuda)  # fmt: skip
    available = []
    for name in fp8.CUDA_BACKENDS:
        probes = {str(blk): fp8_gemm.probe(name, blk, "cuda:0") for blk in ((128, 128), (1, 128))}
        emit(kind="backend", backend=name, validated={k: v[0] for k, v in probes.items()},
             detail={k: v[1] for k, v in probes.items()})  # fmt: skip
        if probes[str((128, 128))][0]:
            available.append(name)
    available.append("dequantized")
    ok = check_correctness([*available, "chunked"])
    ok &= check_fp8_linear()
    benchmark(available)
    emit(kind="done", all_passed=ok, seconds=round(time.time() - started, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
