"""The decode step's absorbed attention alone: over a bf16 cache, fp32 FMAs, AVX512-BF16 dot products, AMX
tiles; over an fp32 cache (``--cache fp32``), AVX2 FMAs and AVX-512 FMAs.

    .venv/bin/python benchmarks/decode_attention.py                  # the table
    .venv/bin/python benchmarks/decode_attention.py --contexts 256,4096 --threads 1,2 --json
    .venv/bin/python benchmarks/decode_attention.py --cache fp32 --batch 16 --threads 1,2

``dsv3_mla_decode`` (src/dsv3/kernels/decode_kernels.c) takes one layer's queries from the query projection to
the heads' outputs: W_UK into the query, RoPE, attention over the latent cache, W_UV. For a bf16 model over
a bf16 cache it runs in fp32 FMAs or, on CPUs with AVX512-BF16, in bf16 dot products (the queries and each
tile's softmax weights rounded to bf16; ``decode_kernels.bf16_dots``), and with the same roundings in AMX
tiles where the CPU has AMX-BF16 (``decode_kernels.amx``; Intel Sapphire Rapids on). An fp32 model's attention
over an fp32 cache runs in 8-lane AVX2 FMAs or, where the CPU has AVX-512F, in 16-lane ones that take up to 16
queries a task (``int_weights.avx512`` chooses). For the ``--preset``'s
attention shape (``small``: 8 heads, latent 128, RoPE 32) this measures, at each context and thread count:

* time: microseconds per call (one layer, ``--batch`` rows, one query token each) of each path, the paths
  alternating
  within every round and each figure the median over ``--repeats`` rounds; warm (the cache and weights
  stay in the CPU's caches between calls, unlike a real decode step, which streams ~100 MB of weights
  between two layers' attentions), so this times the arithmetic;
* accuracy: the relative error (Frobenius norm) of each path's output against the same computation in
  fp32 arithmetic (``mla_decode_reference``), beside that of the module path, whose bf16 einsums
  (``MLA.latent_attention``) round the queries, the scores, the softmax weights and the latent output;
  the dot products and the tiles also against fp32 arithmetic on their own bf16-rounded queries
  (``mla_decode_reference(..., bf16_queries=True)``), which leaves only the rounding of the weights.
  Median and largest over ``--draws`` random inputs (queries, cache, the layer's weights at init).
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
from dsv3.errors import DSV3Error
from dsv3.kernels import decode_kernels as dk
from dsv3.kernels import int_weights as iw
from dsv3.model.mla import MLA
from dsv3.model.rope import apply_rope

PATHS = {"bf16": ("fp32 FMAs", "bf16 dots", "AMX tiles"), "fp32": ("AVX2 FMAs", "AVX-512 FMAs")}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def use(path: str) -> None:
    """The kernels' attention on ``path`` for this process."""
    dk.bf16_dots(path not in ("fp32 FMAs", "AVX2 FMAs"))
    dk.amx(path == "AMX tiles")
    iw.avx512(path != "AVX2 FMAs")


def inputs(mla: MLA, context: int, seed: int, batch: int = 1) -> tuple:
    """mla_decode's arguments for one query token per row over ``context`` cached latents (the layer's dtype),
    seeded."""
    g = torch.Generator().manual_seed(seed)
    H, nope, p, dtype = mla.n_heads, mla.nope, mla.rope, mla.kv_b_proj.weight.dtype
    q = torch.randn(batch, 1, H, nope + p, generator=g).to(dtype)
    angles = torch.rand(batch, 1, p // 2, generator=g) * 6
    kv = torch.randn(batch, context, mla.kv_rank, generator=g).to(dtype)
    pe = torch.randn(batch, context, p, generator=g).to(dtype)
    w_uk, w_uv = mla._absorbed_weights()
    return q, angles.cos(), angles.sin(), w_uk.detach(), w_uv.detach(), kv, pe, None, mla.scale


def module_path(mla: MLA, args: tuple) -> torch.Tensor:
    """The same attention through the module path's einsums (bf16 ones over a bf16 cache), [1, 1, H * v]."""
    q, cos, sin, _, _, kv, pe, _, _ = args
    q_nope, q_pe = q.split([mla.nope, mla.rope], dim=-1)
    q_pe = apply_rope(q_pe, cos, sin).to(q.dtype)
    allowed = torch.ones(1, 1, kv.shape[1], dtype=torch.bool)
    with torch.no_grad():
        return mla.latent_attention(q_nope, q_pe, kv, pe, allowed).flatten(2)


def timed(args: tuple, path: str, calls: int) -> float:
    use(path)
    dk.mla_decode(*args)
    t0 = time.perf_counter()
    for _ in range(calls):
        dk.mla_decode(*args)
    return (time.perf_counter() - t0) / calls


def speed(mla: MLA, paths: tuple[str, ...], context: int, threads: int, batch: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    args = inputs(mla, context, seed=context, batch=batch)
    calls = max(20, 200_000 // (context * batch))
    rounds = {path: [] for path in paths}
    for _ in range(repeats):
        for path in paths:
            rounds[path].append(timed(args, path, calls))
    us = {path: 1e6 * statistics.median(rounds[path]) for path in paths}
    out = {"context": context, "threads": threads, "batch": batch, "us_per_call": us,
           "ns_per_key_and_head": {path: 1e3 * us[path] / (context * batch * mla.n_heads) for path in paths}}
    if "AVX-512 FMAs" in paths:
        out["avx512_speedup"] = us["AVX2 FMAs"] / us["AVX-512 FMAs"]
    if "bf16 dots" in paths:
        out["dots_speedup"] = us["fp32 FMAs"] / us["bf16 dots"]
    if "AMX tiles" in paths:
        out["amx_speedup"] = us["bf16 dots"] / us["AMX tiles"]  # over the dot products
    return out


def accuracy(mla: MLA, paths: tuple[str, ...], context: int, draws: int) -> dict:
    rounded = [p for p in paths if p in ("bf16 dots", "AMX tiles")]  # the paths that round the queries to bf16
    errors = {name: [] for name in (*paths, *(f"{p} vs bf16 queries" for p in rounded), "module path")}
    for seed in range(draws):
        args = inputs(mla, context, seed=1000 + seed)
        ref = dk.mla_decode_reference(*args).float()
        own = dk.mla_decode_reference(*args, bf16_queries=True).float()
        err = lambda got, want=ref, ref=ref: ((got.float() - want).norm() / ref.norm()).item()  # noqa: E731
        for path in paths:
            use(path)
            got = dk.mla_decode(*args)
            errors[path].append(err(got))
            if path in rounded:
                errors[f"{path} vs bf16 queries"].append(err(got, own))
        errors["module path"].append(err(module_path(mla, args)))
    return {"context": context, "draws": draws,
            "relative_error": {k: {"median": statistics.median(v), "max": max(v)} for k, v in errors.items()}}


def report(result: dict) -> str:
    paths = result["paths"]
    ups_of = {"avx512_speedup": "AVX-512 over AVX2", "dots_speedup": "dots over FMAs", "amx_speedup": "tiles over dots"}
    named = [name for key, name in ups_of.items() if key in result["speed"][0]]
    lines = [f"{result['preset']} attention, {result['cache']} cache; kernels: {result['kernels']}",
             "", f"time per call (us, median), one layer, batch {result['batch']}, one query token a row, warm;",
             "speed-ups: " + ", ".join(named) + ":",
             f"{'context':>8} {'threads':>7} " + " ".join(f"{p:>12}" for p in paths) + f" {'speed-ups':>14}"]
    for r in result["speed"]:
        us = r["us_per_call"]
        ups = " ".join(f"{r[key]:.2f}x" for key in ups_of if key in r)
        lines.append(f"{r['context']:>8} {r['threads']:>7} " + " ".join(f"{us[p]:>12.1f}" for p in paths)
                     + f" {ups:>14}")
    lines += ["", "relative error against fp32 arithmetic (median / max over draws):"]
    for r in result["accuracy"]:
        lines.append(f"context {r['context']}, {r['draws']} draws:")
        for name, e in r["relative_error"].items():
            lines.append(f"  {name:<26} {e['median']:.1e} / {e['max']:.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="the model shape whose attention is measured")
    ap.add_argument("--contexts", default="256,2048,4096")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--batch", type=int, default=1, help="rows attended at once, one query token each")
    ap.add_argument("--cache", choices=("bf16", "fp32"), default="bf16", help="the cache's (and model's) dtype")
    ap.add_argument("--repeats", type=int, default=7, help="timing rounds (median)")
    ap.add_argument("--draws", type=int, default=20, help="random inputs per context for the errors")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_scaling import parse_ints

    try:
        contexts, threads = parse_ints(args.contexts, "--contexts"), parse_ints(args.threads, "--threads")
        cfg = preset(args.preset)
        if args.repeats < 1 or args.draws < 1 or args.batch < 1:
            raise DSV3Error("--repeats, --draws and --batch must be at least 1")
    except DSV3Error as exc:
        ap.error(str(exc))
    if not dk.kernels_available():
        sys.exit(f"error: the decode kernels do not run here: {dk.kernel_status()}")
    if args.cache == "bf16" and not dk.bf16_dots():
        sys.exit("error: this CPU lacks AVX512-BF16 (or DSV3_DECODE_BF16_DOTS=0): only one path to measure")
    if args.cache == "fp32" and not iw.avx512(True):
        sys.exit("error: this CPU lacks AVX-512F: only one path to measure")
    paths = PATHS[args.cache] if args.cache == "fp32" or dk.amx() else PATHS["bf16"][:2]
    torch.manual_seed(0)
    mla = MLA(cfg, 0).to({"bf16": torch.bfloat16, "fp32": torch.float32}[args.cache]).eval()
    result = {"benchmark": "decode_attention", "preset": args.preset, "kernels": dk.kernel_status(),
              "cache": args.cache, "paths": list(paths), "batch": args.batch, "speed": [], "accuracy": []}
    try:
        for ctx in contexts:
            for t in threads:
                log(f"context {ctx}, {t} thread(s)")
                result["speed"].append(speed(mla, paths, ctx, t, args.batch, args.repeats))
            result["accuracy"].append(accuracy(mla, paths, ctx, args.draws))
    finally:
        use(paths[-1])
    print(json.dumps(result) if args.json else report(result))


if __name__ == "__main__":
    main()
