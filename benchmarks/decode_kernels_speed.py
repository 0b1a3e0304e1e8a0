"""How close the decode GEMV kernels (src/dsv3/kernels/decode_kernels.c) come to the memory bandwidth.

For the ``small`` preset's matrices (``--shape``: another preset's, or ``large``, decode_speed.py's own larger
shape; the lm_head, the attention projections, the dense MLP and one routed expert as ``dsv3_swiglu_experts``
runs them) in fp32, bf16, FP8 (e4m3, 128x128 block scales) and integer groups (int8, int4: 32 values and an
fp16 scale, ``--weights int8|int4``; their bytes count the scales), at 1 and 2 threads: GB/s of weight bytes
read by the kernel, that as a fraction of the read bandwidth measured in the same run (torch ``x.sum()`` over
256 MB), and torch's ``F.linear`` on the same weights beside it (FP8: dequantized per call, which is what runs
without the kernels). ``--baseline`` adds another build of the kernels (an older ``decode_kernels.c`` or its
``.so``, or ``--baseline-rev REV`` for the file at a git revision) for a before/after comparison in one run
(whole decode steps before and after a change: ``benchmarks/decode_step_ab.py``); ``--avx2`` runs both on
their AVX2 paths, as a CPU without AVX-512 would.

    .venv/bin/python benchmarks/decode_kernels_speed.py                      # the table
    .venv/bin/python benchmarks/decode_kernels_speed.py --baseline-rev main --rows 1,4,16 --json

Every matrix is stacked in copies that together exceed the last-level cache (``--footprint-mb``) and the
calls cycle through them, so weights come from memory as in a real decode step (which reads ~100 MB of
weights per token), not from cache, and on huge pages as the engine keeps them (``dsv3.model.huge_pages``),
like the read-bandwidth probe. Variants of one case alternate within every round (``--repeats``),
so machine load hits them alike; each figure is the median over rounds. Activations: fp32 for fp32
weights, bf16 for bf16, FP8 and integer weights (the decode path's dtypes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv3.errors import DSV3Error
from dsv3.kernels import c_build
from dsv3.kernels import decode_kernels as dk
from dsv3.model import huge_pages
from dsv3.precision.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from dsv3.precision.int_groups import dequantize, quantize
from serve_scaling import parse_ints  # the benchmarks folder is the script's sys.path[0]

KINDS = ("fp32", "bf16", "fp8", "int8", "int4")
ACT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16, "int8": torch.bfloat16,
       "int4": torch.bfloat16}
BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 34 / 32, "int4": 18 / 32}  # per weight, scales included
INT_KIND = {"int8": 3, "int4": 4}  # decode_kernels.c's W_INT8, W_INT4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Case:
    """One matrix (``linear``: [n, k]) or SwiGLU expert (``swiglu``: gate/up [n, k], down [k, n]): one expert a
    call, as a dense MLP and the shared experts run, or with ``stack`` one picked from a stack of experts, as the
    routed ones run (the kernels may take another path for each)."""

    name: str
    op: str
    n: int
    k: int
    stack: bool = False

    @property
    def weights(self) -> int:
        return self.n * self.k * (3 if self.op == "swiglu" else 1)

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.k}" + ("x3" if self.op == "swiglu" else "")


def cases_of(shape: str) -> list[Case]:
    """The matrices of a shape: a config preset, or decode_speed.py's ``large``."""
    from decode_speed import shape as model_shape  # benchmarks/ is on sys.path when a script runs

    c = model_shape(shape)
    heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    return [Case("head", "linear", c.vocab_size, c.hidden_size),
            Case("q_a", "linear", c.q_lora_rank, c.hidden_size),
            Case("q_b", "linear", heads * qk, c.q_lora_rank),
            Case("kv_a", "linear", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
            Case("o", "linear", c.hidden_size, heads * c.v_head_dim),
            Case("mlp", "swiglu", c.intermediate_size, c.hidden_size),
            Case("expert", "swiglu", c.moe_intermediate_size, c.hidden_size, stack=True)]


# ---- kernel libraries -----------------------------------------------------------------------------


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no message)"


def build_library(source: Path, out_dir: Path) -> ctypes.CDLL:
    """Compile a decode_kernels.c with the flags decode_kernels.py uses, and load it (with -mf16c too: earlier
    versions of the file converted FP8 through F16C)."""
    target = out_dir / f"{source.stem}-{abs(hash(source.read_bytes())):x}.so"
    try:
        c_build.build(target, source, ("-mf16c",))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise DSV3Error(f"cannot compile {source}: {last_line(str(exc))}") from None
    return dk._declare(ctypes.CDLL(str(target)))


def _show_kernels_source(rev: str, name: str = "decode_kernels.c") -> subprocess.CompletedProcess:
    """``git show`` of the kernels' C source ``name`` at ``rev``: in dsv3/kernels/, or in dsv3/model/ where it
    lived before the kernels became a layer of their own."""
    root = Path(__file__).resolve().parents[1]
    for where in ("src/dsv3/kernels", "src/dsv3/model"):
        shown = subprocess.run(["git", "show", f"{rev}:{where}/{name}"], capture_output=True, text=True, cwd=root)
        if shown.returncode == 0:
            break
    return shown


def baseline_library(path: str | None, rev: str | None, work: Path) -> ctypes.CDLL | None:
    """The --baseline (.c or .so) or --baseline-rev library, or None."""
    if rev:
        shown = _show_kernels_source(rev)
        if shown.returncode != 0:
            raise DSV3Error(f"--baseline-rev {rev}: {last_line(shown.stderr)}")
        source = work / "baseline.c"
        source.write_text(shown.stdout)
        for header in re.findall(r'^#include "([^"]+)"', shown.stdout, flags=re.M):  # int_groups.h, beside it
            included = _show_kernels_source(rev, header)
            if included.returncode != 0:
                raise DSV3Error(f"--baseline-rev {rev}: {last_line(included.stderr)}")
            (work / header).write_text(included.stdout)
        return build_library(source, work)
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        raise DSV3Error(f"--baseline {path}: no such file")
    if file.suffix == ".c":
        return build_library(file, work)
    try:
        return dk._declare(ctypes.CDLL(str(file.resolve())))
    except (OSError, AttributeError) as err:
        raise DSV3Error(f"--baseline {path}: not a decode-kernels library ({err})") from None


# ---- one case's weights, stacked past the cache ---------------------------------------------------


def weight_stack(kind: str, copies: int, n: int, k: int, seed: int) -> dk.Weight:
    """``copies`` matrices [n, k] as one Weight [copies, n, k] (FP8: one quantized matrix, repeated)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / math.sqrt(k)
    if kind in INT_KIND:  # values as w, fp16 group scales as scale_inv (the kernel's "scales")
        q, s = quantize(w, int(kind[3]))
        return dk.Weight(huge_pages.clone(q.expand(copies, *q.shape)), s.expand(copies, *s.shape).contiguous(),
                         torch.bfloat16)
    if kind == "fp8":
        q, s = quantize_weight_blocks(w)
        return dk.Weight(huge_pages.clone(q.expand(copies, n, k)), s.expand(copies, *s.shape).contiguous(),
                         torch.bfloat16)
    return dk.Weight(huge_pages.clone(w.to(ACT[kind]).expand(copies, n, k)))


def dense(w: dk.Weight, c: int) -> torch.Tensor:
    if w.scale_inv is None:
        return w.w[c]
    if w.w.dtype in (torch.int8, torch.uint8):
        return dequantize(w.w[c], w.scale_inv[c], w.dtype)
    return dequantize_weight_blocks(w.w[c], w.scale_inv[c], w.dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Runner:
    """Calls for one case: the kernel (any library) and torch, each cycling through the copies."""

    def __init__(self, case: Case, kind: str, rows: int, footprint: int):
        self.case, self.kind, self.rows = case, kind, rows
        per_copy = int(case.weights * BYTES[kind])
        self.copies = max(1, -(-footprint // per_copy))
        self.x = torch.randn(rows, case.k).to(ACT[kind])
        if case.op == "linear":
            self.w = weight_stack(kind, self.copies, case.n, case.k, 0)
            self.out = torch.empty(rows, case.n, dtype=ACT[kind])
        else:
            self.g, self.u = (weight_stack(kind, self.copies, case.n, case.k, s) for s in (1, 2))
            self.d = weight_stack(kind, self.copies, case.k, case.n, 3)
            self.gates = torch.ones(rows, 1)
            self.out = torch.empty(rows, case.k, dtype=ACT[kind])

    @property
    def weight_bytes(self) -> int:
        return int(self.case.weights * BYTES[self.kind])

    def scales(self, w: dk.Weight) -> tuple[int | None, int, int]:
        """(address, bytes per copy) of the scales the kernel reads, and the weight kind: FP8's times 256, the
        integer groups' fp16 as stored."""
        s = w.scale_inv if self.kind in INT_KIND else w.kernel_scale
        kind = INT_KIND.get(self.kind, dk.W_KIND.get(w.w.dtype))
        return (None, 0, kind) if s is None else (s.data_ptr(), s[0].nbytes, kind)

    def kernel(self, lib: ctypes.CDLL, threads: int) -> None:
        x, out, a = self.x, self.out, dk.A_KIND[self.x.dtype]
        if self.case.op == "linear":
            w = self.w
            n, k = w.w.shape[1:]
            n, k = (n, k * 2) if self.kind == "int4" else (n, k)
            step = w.w[0].nbytes
            scale, scale_step, kind = self.scales(w)
            for c in range(self.copies):
                lib.dsv3_linear(w.w.data_ptr() + c * step, None if scale is None else scale + c * scale_step, kind,
                                n, k, x.data_ptr(), a, self.rows, out.data_ptr(), a, threads)
            return
        g, u, d = self.g, self.u, self.d
        n, k = self.case.n, self.case.k
        scales = [self.scales(t) for t in (g, u, d)]
        kind = scales[0][2]
        for c in range(self.copies):
            if self.case.stack:  # expert c of the stack
                E, at, idx = g.w.shape[0], 0, torch.full((self.rows, 1), c, dtype=torch.long)
            else:  # copy c alone
                E, at, idx = 1, c, torch.zeros(self.rows, 1, dtype=torch.long)
            w = [t.w.data_ptr() + at * t.w[0].nbytes for t in (g, u, d)]
            sc = [None if s is None else s + at * step for s, step, _ in scales]
            lib.dsv3_swiglu_experts(*w, *sc, kind, E, n, k, x.data_ptr(), a, self.rows, idx.data_ptr(),
                                    self.gates.data_ptr(), 1, out.data_ptr(), a, 0, threads)

    def torch(self, threads: int) -> None:
        torch.set_num_threads(threads)
        x = self.x
        for c in range(self.copies):
            if self.case.op == "linear":
                F.linear(x, dense(self.w, c).to(x.dtype))
            else:
                h = F.silu(F.linear(x, dense(self.g, c).to(x.dtype))) * F.linear(x, dense(self.u, c).to(x.dtype))
                F.linear(h, dense(self.d, c).to(x.dtype))


def seconds_per_call(fn, copies: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / copies


def read_bandwidth(x: torch.Tensor, threads: int) -> float:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    x.sum()
    return x.nbytes / (time.perf_counter() - t0)


# ---- the run --------------------------------------------------------------------------------------


def run(cases: list[Case], kinds: list[str], threads: list[int], rows: list[int], repeats: int, footprint: int,
        base: ctypes.CDLL | None, with_torch: bool = True) -> dict:
    lib = dk._load()[0]
    if lib is None:
        raise DSV3Error(f"the C kernels do not run here: {dk.kernel_status()}")
    big = huge_pages.clone(torch.ones(256 * 2**20 // 4))
    bw: dict[int, list[float]] = {t: [] for t in threads}
    results = []
    with torch.inference_mode():
        for case in cases:
            for kind in kinds:
                for m in rows:
                    runner = Runner(case, kind, m, footprint)
                    variants = {"kernel": lambda t, r=runner: r.kernel(lib, t)}
                    if with_torch:
                        variants["torch"] = runner.torch
                    # a baseline may predate integer weights (their kernels came with dsv3_int_avx512)
                    if base is not None and (kind not in INT_KIND or hasattr(base, "dsv3_int_avx512")):
                        variants["baseline"] = lambda t, r=runner: r.kernel(base, t)
                    for fn in variants.values():  # warm-up: page in every copy, build nothing lazily
                        fn(threads[0])
                    times = {(v, t): [] for v in variants for t in threads}
                    for _ in range(repeats):
                        for t in threads:
                            bw[t].append(read_bandwidth(big, t))
                            for v, fn in variants.items():
                                times[v, t].append(seconds_per_call(lambda fn=fn, t=t: fn(t), runner.copies))
                    for t in threads:
                        row = {"matrix": case.name, "shape": case.shape, "kind": kind, "rows": m, "threads": t,
                               "weight_bytes": runner.weight_bytes, "copies": runner.copies}
                        for v in variants:
                            sec = statistics.median(times[v, t])
                            row[f"{v}_us"] = sec * 1e6
                            row[f"{v}_gbs"] = runner.weight_bytes / sec / 1e9
                        results.append(row)
                    log(f"{case.name} {kind} rows={m}: " + ", ".join(
                        f"{r['threads']} thr {r['kernel_gbs']:.1f} GB/s" for r in results[-len(threads):]))
                    del runner
    bandwidth = {t: statistics.median(v) / 1e9 for t, v in bw.items()}
    for row in results:
        row["kernel_fraction_of_bw"] = row["kernel_gbs"] / bandwidth[row["threads"]]
    return {"bandwidth_gbs": {str(t): b for t, b in bandwidth.items()}, "results": results,
            "footprint_mb": footprint / 2**20, "repeats": repeats, "baseline": base is not None, "torch": with_torch}


def print_table(report: dict) -> None:
    bws = ", ".join(f"{t} thread{'s' if t != '1' else ''} {b:.1f} GB/s" for t, b in report["bandwidth_gbs"].items())
    print(f"read bandwidth (torch x.sum(), 256 MB): {bws}")
    print("GB/s of weight bytes (median); 'of bw': kernel / read bandwidth; x: kernel speed-up")
    base = report["baseline"]
    head = f"{'matrix':<7}{'shape':>13} {'kind':<5}{'M':>3}{'thr':>4} {'kernel':>7} {'of bw':>6}"
    head += f" {'base':>6} {'x':>5}" if base else ""
    print(head + (f" {'torch':>6} {'x':>5}" if report["torch"] else ""))
    for r in report["results"]:
        line = (f"{r['matrix']:<7}{r['shape']:>13} {r['kind']:<5}{r['rows']:>3}{r['threads']:>4} "
                f"{r['kernel_gbs']:>7.1f} {r['kernel_fraction_of_bw']:>6.2f}")
        if base and "baseline_gbs" in r:
            line += f" {r['baseline_gbs']:>6.1f} {r['kernel_gbs'] / r['baseline_gbs']:>5.2f}"
        elif base:
            line += f" {'-':>6} {'-':>5}"
        if report["torch"]:
            line += f" {r['torch_gbs']:>6.1f} {r['kernel_gbs'] / r['torch_gbs']:>5.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rows", default="1", help="activation rows per call, comma-separated (up to 64)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"weight kinds: {','.join(KINDS)}")
    ap.add_argument("--shape", default="small", help="whose matrices: a config preset or decode_speed.py's large "
                    "(default: small)")
    ap.add_argument("--matrices", default="", help="a subset of head,q_a,q_b,kv_a,o,mlp,expert (default: all)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--footprint-mb", type=int, default=96, help="the copies of each matrix, together")
    ap.add_argument("--baseline", help="another decode_kernels.c or its .so, timed beside this tree's")
    ap.add_argument("--baseline-rev", help="a git revision whose decode_kernels.c is the baseline")
    ap.add_argument("--no-torch", action="store_true", help="leave out torch's F.linear (slow at many rows)")
    ap.add_argument("--avx2", action="store_true",
                    help="both builds on their AVX2 paths, as on a CPU without AVX-512 (dsv3_int_avx512(0))")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    try:
        threads, rows = parse_ints(args.threads, "--threads"), parse_ints(args.rows, "--rows")
        if max(rows) > dk.MAX_KERNEL_ROWS:
            raise DSV3Error(f"--rows: the kernels take at most {dk.MAX_KERNEL_ROWS} rows")
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        if not kinds or any(k not in KINDS for k in kinds):
            raise DSV3Error(f"--kinds must list some of {','.join(KINDS)}, got {args.kinds!r}")
        cases = cases_of(args.shape)
        if args.matrices:
            wanted = [m.strip() for m in args.matrices.split(",") if m.strip()]
            unknown = sorted(set(wanted) - {c.name for c in cases})
            if unknown:
                raise DSV3Error(f"--matrices: unknown {','.join(unknown)}; known: {','.join(c.name for c in cases)}")
            cases = [c for c in cases if c.name in wanted]
        if args.repeats < 1 or args.footprint_mb < 1:
            raise DSV3Error("--repeats and --footprint-mb must be >= 1")
        with tempfile.TemporaryDirectory() as work:
            base = baseline_library(args.baseline, args.baseline_rev, Path(work))
            if args.avx2:
                for lib in (dk._load()[0], base):
                    if lib is not None and hasattr(lib, "dsv3_int_avx512"):
                        lib.dsv3_int_avx512.argtypes, lib.dsv3_int_avx512.restype = [ctypes.c_int], ctypes.c_int
                        lib.dsv3_int_avx512(0)
            report = {"shape": args.shape, **run(cases, kinds, threads, rows, args.repeats, args.footprint_mb * 2**20,
                                                 base, not args.no_torch)}
    except DSV3Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
