"""Batch-1 decode steps of the block kernel, before and after a change to ``decode_kernels.c``, in one run.

    .venv/bin/python benchmarks/decode_step_ab.py --baseline-rev HEAD~3 --json > decode_step_ab.json

Builds the ``small`` preset shape with random weights (as ``decode_speed.py`` measures it), prefills each
context once, and then decodes through the engine's fast path while the C library under the block kernel
alternates step by step between the kernels of ``--baseline-rev`` and those of this tree (the same
engine, model and cache; only the library's functions change), so that machine load hits both alike.
Each figure is the median over ``--rounds`` of the mean time of ``--steps`` steps, with its roofline
fraction computed as ``decode_speed.py`` does (the bytes a step reads over the best read bandwidth seen in
the run, divided by the time per step). ``--phases`` builds both libraries with ``-DDSV3_BLOCK_PROFILE``
and adds the median time per step of each phase of ``dsv3_decode_block`` (norms, query and key/value
projections, cache write, attention, output projection, router, routed and shared experts) for the
libraries that have the timers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_speed import add_roofline, cache_bytes_per_token, figure, read_bandwidth, weight_bytes_per_token  # noqa: E402
from dsv3.config import preset  # noqa: E402
from dsv3.errors import DSV3Error  # noqa: E402
from dsv3.infer.engine import Engine, Request  # noqa: E402
from dsv3.model import Transformer  # noqa: E402
from dsv3.model import decode_kernels as dk  # noqa: E402
from serve_scaling import parse_ints  # noqa: E402

PHASES = ("norm", "q", "kv", "latent", "attention", "o", "route", "routed", "shared")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(source: Path, target: Path, profile: bool) -> ctypes.CDLL:
    """Compile one version of decode_kernels.c (as decode_kernels.py does, plus the phase timers)."""
    flags = [*dk.FLAGS, *(["-DDSV3_BLOCK_PROFILE"] if profile else [])]
    subprocess.run(["cc", *flags, str(source), "-o", str(target), "-lm"], check=True, capture_output=True, text=True)
    return dk._declare(ctypes.CDLL(str(target)))


def libraries(rev: str, profile: bool, folder: Path) -> dict[str, ctypes.CDLL]:
    """{"baseline (REV)": ..., "this tree": ...}: the kernels of git revision ``rev`` and of the working tree."""
    old = folder / "baseline.c"
    text = subprocess.run(["git", "show", f"{rev}:src/dsv3/model/decode_kernels.c"], check=True, capture_output=True,
                          text=True, cwd=dk.SOURCE.parent).stdout
    old.write_text(text)
    return {f"baseline ({rev})": build(old, folder / "baseline.so", profile),
            "this tree": build(dk.SOURCE, folder / "tree.so", profile)}


def use(lib: ctypes.CDLL) -> None:
    """Make the decode kernels (and so the block kernel) call ``lib`` from the next call on."""
    dk._load = lambda: (lib, "ok")


def phases_of(lib: ctypes.CDLL) -> list[float] | None:
    """The block kernel's phase times since the last call (seconds), reset; None without the timers."""
    try:
        fn = lib.dsv3_block_profile
    except AttributeError:
        return None
    out = (ctypes.c_double * 16)()
    fn(out, 1)
    return list(out[: len(PHASES)])


def measure(model: Transformer, libs: dict, ctx: int, steps: int, rounds: int) -> dict[str, dict]:
    """Median ms per step (and per phase) of each library, the libraries alternating round by round."""
    engine = Engine(model, eos_token_ids=frozenset(), fast=True)
    prompt = torch.randint(0, model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
    times = {name: [] for name in libs}
    phases = {name: [] for name in libs}
    with torch.inference_mode():
        batch = engine.start([Request(prompt, rounds * len(libs) * (steps + 1) + 8)])
        for _ in range(5):  # warm-up: the first steps after prefill are slower
            batch.step()
        for _ in range(rounds):
            for name, lib in libs.items():
                use(lib)
                batch.step()  # the first step on this library, untimed
                phases_of(lib)
                t0 = time.perf_counter()
                for _ in range(steps):
                    batch.step()
                times[name].append((time.perf_counter() - t0) / steps)
                ph = phases_of(lib)
                if ph is not None:
                    phases[name].append([p / steps for p in ph])
    out = {}
    for name in libs:
        out[name] = {"seconds": statistics.median(times[name])}
        if phases[name]:
            columns = zip(*phases[name], strict=True)
            out[name]["phases_ms"] = {p: 1000 * statistics.median(c) for p, c in zip(PHASES, columns, strict=True)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default="HEAD", help="git revision whose decode_kernels.c is the baseline")
    ap.add_argument("--contexts", default="256,2048,4096")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and library")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--phases", action="store_true", help="time dsv3_decode_block's phases (profiling builds)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        args.contexts, args.threads = parse_ints(args.contexts, "--contexts"), parse_ints(args.threads, "--threads")
    except DSV3Error as exc:
        ap.error(str(exc))
    dtypes = args.dtypes.split(",")
    if any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes: each one of {', '.join(DTYPES)}")
    if dk._load()[0] is None:
        ap.error(f"the C kernels do not run here: {dk.kernel_status()}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = libraries(args.baseline_rev, args.phases, Path(tmp))
        bandwidth = {t: read_bandwidth(t) for t in args.threads}
        rows = []
        for dtype in dtypes:
            torch.manual_seed(0)
            model = Transformer(preset("small")).to(DTYPES[dtype]).eval()
            cache_element = DTYPES[dtype].itemsize  # the engine's cache takes the model's dtype
            for threads in args.threads:
                for ctx in args.contexts:
                    torch.set_num_threads(threads)
                    log(f"{dtype}, {threads} thread(s), context {ctx}")
                    result = measure(model, libs, ctx, args.steps, args.rounds)
                    bandwidth[threads] = max(bandwidth[threads], read_bandwidth(threads, 128, 3))
                    row = {"dtype": dtype, "threads": threads, "context": ctx}
                    for name, r in result.items():
                        row[name] = figure(r["seconds"], weight_bytes_per_token(model),
                                           cache_bytes_per_token(model.config, ctx, cache_element), threads)
                        if "phases_ms" in r:
                            row[name]["phases_ms"] = r["phases_ms"]
                    rows.append(row)
    add_roofline(rows, bandwidth)
    for row in rows:
        base, tree = (row[name] for name in libs)
        row["time_ratio"] = tree["ms_per_step"] / base["ms_per_step"]
    result = {"baseline_rev": args.baseline_rev, "read_bandwidth_gb_s": {t: b / 1e9 for t, b in bandwidth.items()},
              "rows": rows}
    print(json.dumps(result, indent=1) if args.json else report(result, list(libs)))


def report(result: dict, names: list[str]) -> str:
    lines = [f"read bandwidth (GB/s): {result['read_bandwidth_gb_s']}",
             "dtype threads context | " + " | ".join(f"{n}: ms/step tokens/s (roofline)" for n in names)
             + " | time ratio"]
    for row in result["rows"]:
        cells = [f"{row[n]['ms_per_step']:.2f} {row[n]['tokens_per_s']:.1f} ({row[n]['roofline_fraction']:.2f})"
                 for n in names]
        lines.append(f"{row['dtype']} {row['threads']} {row['context']} | " + " | ".join(cells)
                     + f" | {row['time_ratio']:.3f}")
        for n in names:
            if "phases_ms" in row[n]:
                lines.append(f"    {n} phases (ms/step): "
                             + " ".join(f"{p}={v:.3f}" for p, v in row[n]["phases_ms"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
