"""CUDA checks of the LogFMT codec: encode/decode on the GPU give exactly the CPU's bytes and values,
and their throughput against a plain copy of the same BF16 tensor.

JSON lines on stdout; exit 1 when a check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on the CPU (to test this script without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from dsv3.precision import logfmt

DEVICE = os.environ.get("DSV3_GPU_CHECK_DEVICE", "cuda")


def emit(**fields) -> None:
    print(json.dumps({"check": "logfmt", **fields}), flush=True)


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    ok = True
    x = torch.randn(512, 7168, generator=torch.Generator().manual_seed(0)).bfloat16()
    for bits in (8, 10):
        cpu_packed = logfmt.encode(x, bits)
        gpu_packed = logfmt.encode(x.to(DEVICE), bits)
        same_bytes = torch.equal(cpu_packed.payload, gpu_packed.payload.cpu())
        same_values = torch.equal(logfmt.decode(gpu_packed).cpu(), logfmt.quantize(x, bits))
        ok &= same_bytes and same_values
        emit(name=f"logfmt{bits}_gpu_equals_cpu", same_bytes=same_bytes, same_values=same_values)
    big = torch.randn(4096, 7168, device=DEVICE).bfloat16()
    copy_ms = timed_ms(lambda: big.clone())
    for bits in (8, 10):
        packed = logfmt.encode(big, bits)
        emit(name=f"logfmt{bits}_speed", copy_ms=copy_ms, encode_ms=timed_ms(lambda b=bits: logfmt.encode(big, b)),
             decode_ms=timed_ms(lambda p=packed: logfmt.decode(p)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
