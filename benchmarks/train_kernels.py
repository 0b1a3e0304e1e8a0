"""The measurements behind docs/training.md "Speed": each fused training kernel against what it replaced,
and the matmul roofline that caps the fp32 speed-up over transformers.

    .venv/bin/python benchmarks/train_kernels.py --threads 2 --json            # every section
    .venv/bin/python benchmarks/train_kernels.py --sections roofline --json

Sections (each a median of --repeats timed runs after one warm-up):
  loss        output head + cross-entropy, forward and backward: fused (dsv3.model.kernels) vs the plain
              matmul + F.cross_entropy, at the nano and small shapes (2048 tokens)
  experts     one routed-expert layer (nano and small shapes, bf16 autocast), forward and backward, with
              new expert row counts every step vs the same counts, with and without padding rows to a
              multiple of 32
  attention   attention_core forward and backward at a small layer's shape: explicit matmuls vs SDPA
  fresh       a [2048, 512] x [512, 16384] matmul into a fresh tensor vs into a reused one (page faults)
  roofline    matmul FLOPs of a training step (6 x activated matmul weights x tokens, dsv3.analysis),
              the time dsv3's step spends in matmuls (torch.profiler), the GEMM rate they reach, and the
              fastest transformers could be beaten if nothing but those matmuls remained
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.model import kernels
from dsv3.model.kernels import linear_cross_entropy, plain_cross_entropy

SECTIONS = ("loss", "experts", "attention", "fresh", "roofline")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


def bench_loss(repeats: int) -> dict:
    out = {}
    for name, (d, v) in {"nano": (128, 4096), "small": (512, 16384)}.items():
        g = torch.Generator().manual_seed(0)
        h = torch.randn(2048, d, generator=g).requires_grad_()
        w = (torch.randn(v, d, generator=g) * 0.05).requires_grad_()
        y = torch.randint(0, v, (2048,), generator=g)
        fused = median_ms(lambda: linear_cross_entropy(h, w, y).backward(), repeats)  # noqa: B023
        plain = median_ms(lambda: plain_cross_entropy(h @ w.t(), y).backward(), repeats)  # noqa: B023
        out[name] = {"fused_ms": fused, "plain_ms": plain}
    return out


def bench_experts(repeats: int) -> dict:
    return {name: _bench_expert_layer(repeats, *shape)
            for name, shape in {"nano": (16, 128, 64), "small": (32, 512, 256)}.items()}


def _bench_expert_layer(repeats: int, n_experts: int, dim: int, inter: int, tokens: int = 2048, top_k: int = 4):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n_experts, inter, dim, generator=g).requires_grad_(),
               torch.randn(n_experts, inter, dim, generator=g).requires_grad_(),
               torch.randn(n_experts, dim, inter, generator=g).requires_grad_()]
    x = torch.randn(tokens, dim, generator=g).requires_grad_()
    seeds = iter(range(1, 10**6))

    def step(seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, n_experts, (tokens, top_k), generator=rng)
        order = idx.flatten().argsort(stable=True)
        counts = torch.bincount(idx.flatten(), minlength=n_experts).tolist()
        gates = torch.rand(tokens * top_k, generator=rng)[order]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = kernels.routed_swiglu(x, gates, order // top_k, counts, *weights)
        out.float().sum().backward()

    default, out = kernels.CPU_LOW_PRECISION_ROW_MULTIPLE, {}
    for multiple in (1, default):
        kernels.CPU_LOW_PRECISION_ROW_MULTIPLE = multiple
        out[f"rows_multiple_{multiple}"] = {
            "same_counts_ms": median_ms(lambda: step(0), repeats),
            "new_counts_ms": median_ms(lambda: step(next(seeds)), repeats),
        }
    kernels.CPU_LOW_PRECISION_ROW_MULTIPLE = default
    return out


def bench_attention(repeats: int) -> dict:
    B, H, T, d_qk, d_v = 8, 8, 256, 96, 64  # one layer of the small preset, batch 8 x 256
    limit, out = kernels.EXPLICIT_SCORES_LIMIT, {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(B, H, T, d_qk, generator=g).to(dtype).requires_grad_() for _ in range(2))
        v = torch.randn(B, H, T, d_v, generator=g).to(dtype).requires_grad_()
        row = {}
        for kernel, explicit_limit in (("explicit", 1 << 62), ("sdpa", 0)):
            kernels.EXPLICIT_SCORES_LIMIT = explicit_limit
            attend = kernels.attention_core
            row[f"{kernel}_ms"] = median_ms(lambda: attend(q, k, v, d_qk**-0.5).sum().backward(), repeats)  # noqa: B023
        out[str(dtype).removeprefix("torch.")] = row
    kernels.EXPLICIT_SCORES_LIMIT = limit
    return out


def bench_fresh(repeats: int) -> dict:
    a, b = torch.randn(2048, 512), torch.randn(16384, 512)
    buf = torch.empty(2048, 16384)
    fresh = median_ms(lambda: a @ b.t(), repeats)
    reused = median_ms(lambda: torch.mm(a, b.t(), out=buf), repeats)
    gflop = 2 * 2048 * 512 * 16384 / 1e9
    return {"fresh_output_ms": fresh, "reused_output_ms": reused,
            "reused_output_gflops": round(gflop / reused * 1e3, 1)}


def bench_roofline(preset_name: str, precision: str, repeats: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import train_throughput as tt
    from dsv3.analysis.arch import from_model_config
    from dsv3.analysis.params import count_params

    ours, hf, _ = tt.build_models(preset_name, mtp=False)
    batch, seq = 8, 256
    counts = count_params(from_model_config(ours.config))
    gemm_flops = 6 * counts.matmul_active * batch * seq  # every projection, expert and the head; fwd + bwd
    rows = torch.randint(0, ours.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (ours, hf)}
    step = {ours: tt.ours_step, hf: tt.hf_step}
    times = {ours: [], hf: []}
    for i in range(repeats + 1):
        for m in (ours, hf):
            dt = tt.timed(step[m], m, opts[m], rows[:, :-1], rows[:, 1:], precision=precision)
            if i:
                times[m].append(dt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = tt.timed(tt.ours_step, ours, opts[ours], rows[:, :-1], rows[:, 1:], precision=precision)
    matmul_s = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / 1e6
    projections_s = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS[:3]) / 1e6
    ours_s, hf_s = statistics.median(times[ours]), statistics.median(times[hf])
    return {
        "preset": preset_name, "precision": precision, "tokens": batch * seq,
        "projection_gflop_per_step": round(gemm_flops / 1e9, 1),
        "dsv3_step_s": round(ours_s, 3), "transformers_step_s": round(hf_s, 3),
        "profiled_step_s": round(profiled, 3),
        "profiled_matmul_s": round(matmul_s, 3),
        "profiled_projection_matmul_s": round(projections_s, 3),
        "projection_gflops": round(gemm_flops / projections_s / 1e9, 1),
        "speedup": round(hf_s / ours_s, 3),
        "speedup_if_only_matmuls_remained": round(hf_s / matmul_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--preset", default="small", help="roofline: the preset")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="roofline: the precision")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset(args.preset)  # a bad preset name fails here, before any measurement
    runners = {"loss": bench_loss, "experts": bench_experts, "attention": bench_attention, "fresh": bench_fresh,
               "roofline": lambda r: bench_roofline(args.preset, args.precision, r)}
    result = {"threads": torch.get_num_threads(), "repeats": args.repeats}
    for name in chosen:
        result[name] = runners[name](args.repeats)
        print(f"{name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
