"""Which reading of Hopper's FP8 accumulator is the real one? Measure it.

`torch._scaled_mm(..., use_fast_accum=True)` on H100/H200 accumulates an FP8 GEMM in the tensor core's
narrow adder without promotion; `use_fast_accum=False` promotes (cuBLAS). On the same E4M3 operands as
`dsv3 study accumulation` (64 x K N(0,1) matrices, one scale per tensor) this prints the measured
normwise relative error against the exact product next to what each emulated reading predicts: the
default, bit-accurate Hopper model (MMA-Sim; Khattak & Mikaitis), the floor truncation the V3 report's
"sign-fill" wording suggests, 14 fraction bits and products-only alignment. One GPU run checks the
default model on this machine and whether anything here reproduces the report's "nearly 2% at K = 4096".

JSON lines on stdout; exit 0 with a "skipped" line without CUDA (the emulator rows print anyway).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from dsv3.precision.accumulation import Accumulator, fp8_random, limited_matmul, matrix_error

KS = [1024, 4096, 16384]
# The bit-accurate Hopper model (the study's default, `Accumulator()`) and three other readings, each
# changing one option of it (as in `dsv3 study accumulation --readings`).
READINGS = {
    "default: bit-accurate Hopper model (13 bits, sum joins alignment, toward zero)": Accumulator(),
    "sign-fill shift on two's complement: floor (previous default)": Accumulator(product_rounding="floor"),
    "14 fraction bits": Accumulator(fraction_bits=14),
    "products-only alignment": Accumulator(align_with_accumulator=False),
}


def emit(**fields) -> None:
    print(json.dumps({"check": "accumulation", **fields}), flush=True)


def measured(a: np.ndarray, b: np.ndarray, fast_accum: bool) -> np.ndarray:
    qa = torch.from_numpy(a).float().to(torch.float8_e4m3fn).cuda()
    qb = torch.from_numpy(b).float().to(torch.float8_e4m3fn).cuda()
    one = torch.tensor(1.0, device="cuda")
    out = torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum)
    return out.double().cpu().numpy()


def main() -> int:
    rng = np.random.default_rng(0)
    a, b = fp8_random((64, max(KS)), "normal", rng), fp8_random((64, max(KS)), "normal", rng)
    for name, acc in READINGS.items():
        approx = limited_matmul(a, b, KS, acc)
        emit(source="emulator", reading=name,
             normwise={k: matrix_error(approx[k], a[:, :k] @ b[:, :k].T, a, b, "normwise") for k in KS})
    if not torch.cuda.is_available():
        emit(skipped="no CUDA device: no hardware measurement")
        return 0
    for fast in (True, False):
        errors = {k: matrix_error(measured(a[:, :k], b[:, :k], fast), a[:, :k] @ b[:, :k].T, a, b, "normwise")
                  for k in KS}
        emit(source=torch.cuda.get_device_name(), use_fast_accum=fast, normwise=errors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
