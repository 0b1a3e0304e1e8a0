"""LogFMT encode and decode throughput on CPU, against copying the same BF16 tensor.

One [rows, cols] BF16 activation (default [4096, 7168]: 4096 tokens of DeepSeek-V3's hidden size) is
encoded and decoded at each bit width. Every repeat times a plain copy (`clone`), `encode`, `decode` and
`quantize` back to back, so machine load hits all of them alike; medians are reported. GB/s counts the
BF16 bytes (input of encode, output of decode); `x_copy` is the time relative to the copy, the figure the
paper's 50-100% overhead (fused into the GPU all-to-all) is about.

    .venv/bin/python benchmarks/logfmt_throughput.py --bits 8,10 --repeats 5 --threads 1

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from dsv3.precision import logfmt


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_bits(x: torch.Tensor, bits: int, repeats: int) -> dict:
    packed = logfmt.encode(x, bits)
    assert torch.equal(logfmt.decode(packed), logfmt.quantize(x, bits))  # warm-up, and a sanity check
    ops = {
        "copy": lambda: x.clone(),
        "encode": lambda: logfmt.encode(x, bits),
        "decode": lambda: logfmt.decode(packed),
        "quantize": lambda: logfmt.quantize(x, bits),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            samples[name].append(timed(fn))
    bf16_bytes = x.numel() * x.element_size()
    wall = {name: statistics.median(s[0] for s in runs) for name, runs in samples.items()}
    cpu = {name: statistics.median(s[1] for s in runs) for name, runs in samples.items()}
    result = {
        name: {
            "median_s": wall[name],
            "median_cpu_s": cpu[name],
            "gb_per_s": bf16_bytes / wall[name] / 1e9,
            "x_copy": wall[name] / wall["copy"],
            "gb_per_s_cpu": bf16_bytes / cpu[name] / 1e9,  # CPU time: steadier on a shared machine
            "x_copy_cpu": cpu[name] / cpu["copy"],
        }
        for name in ops
    }
    result["bytes"] = {
        "bf16": bf16_bytes,
        "payload": packed.payload_bytes,
        "metadata": packed.metadata_bytes,
        "total": packed.nbytes,
        "bits_per_element": packed.bits_per_element,
        "vs_bf16": packed.nbytes / bf16_bytes,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--bits", default="8,10", help="comma-separated bit widths, 4..16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    x = (torch.randn(args.rows, args.cols, generator=generator) * 0.05).to(torch.bfloat16)
    results = {}
    for bits in (int(b) for b in args.bits.split(",")):
        print(f"LogFMT-{bits}: {args.repeats} repeats on [{args.rows}, {args.cols}] bf16", file=sys.stderr)
        results[f"logfmt{bits}"] = bench_bits(x, bits, args.repeats)
    report = {
        "benchmark": "logfmt_throughput",
        "shape": [args.rows, args.cols],
        "dtype": "bfloat16",
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "results": results,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
