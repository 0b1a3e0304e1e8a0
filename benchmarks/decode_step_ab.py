"""Decode steps of dsv3's fast path at a git revision and in this tree, interleaved in one run.

    .venv/bin/python benchmarks/decode_step_ab.py --baseline-rev 6d8d4ab --json > decode_step_ab.json
    .venv/bin/python benchmarks/decode_step_ab.py --baseline-rev 6d8d4ab --batches 1,16 --contexts 1024 --threads 1

For each weight dtype, thread count, batch size and context, two worker processes build the ``--preset`` shape
(``small`` by default) with random weights (as ``decode_speed.py`` measures it; the same seed, so the same
model), prefill the same prompts (one per row of the batch) once and then wait: one runs the revision's
``src`` (exported with ``git archive``: its Python and its C kernels), the other this tree's. The parent has
them decode ``--steps`` timed steps in turn (each turn after a pause and ``TURN_WARM_UP`` untimed steps),
``--rounds`` times, so that machine load hits both alike; each figure is the median over the rounds of the
mean time per step, with its roofline fraction computed as ``decode_speed.py`` does (the bytes a step reads
over the best read bandwidth measured in the run, divided by the time per step).

``--phases`` builds each side's kernels with ``-DDSV3_BLOCK_PROFILE`` and adds the median time per step
of each phase of ``dsv3_decode_block`` (norms, query and key/value projections, cache write, attention,
output projection, router, routed and shared experts), for a side whose kernels have the timers.
``--avx2`` runs both sides on the kernels' AVX2 paths (no AVX-512, bf16 dot products or AMX), as on a CPU
without AVX-512.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.errors import DSV3Error
from dsv3.model import Transformer

# The parent's helpers (decode_speed's roofline, the list parsers) are imported in main(), not here: a worker
# runs this file against an older revision's src, which may lack what they import.

PHASES = ("norm", "q", "kv", "latent", "attention", "o", "route", "routed", "shared")
# fp8: FP8 resident weights; int8, int4: integer experts (``--weights int8|int4``) in a bf16 model
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16, "int8": torch.bfloat16,
          "int4": torch.bfloat16}
REPO = Path(__file__).resolve().parent.parent
WARM_UP = 5  # decode steps before the timed ones
# A turn starts TURN_PAUSE_S after the last one ended and with TURN_WARM_UP untimed steps. OpenMP threads
# spin for a while after their last parallel region before they sleep: without the pause, the side that had
# just run spun on the cores the next one needed, and on a 2-core host 2 threads measured slower than 1
# (small, bf16, batch 1, context 256: 4.2 against 2.9 ms a step, against 1.8 ms for one worker alone). After
# the pause the turn's own threads are asleep and its caches cold: the untimed steps wake and warm them.
TURN_PAUSE_S = 0.05
TURN_WARM_UP = 2


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def config_of(shape: str):
    """A config preset, or one of decode_speed.py's own shapes (``large``), imported only then."""
    try:
        return preset(shape)
    except DSV3Error:
        from decode_speed import shape as benchmark_shape

        return benchmark_shape(shape)


def random_model(shape: str, dtype: str) -> Transformer:
    """The shape with seeded random weights; for "fp8" a bf16 model whose projections and experts are
    quantized to resident FP8 (128x128 blocks), as decode_speed.py loads an FP8 checkpoint; for "int8" and
    "int4" one whose experts are integer groups, as ``--weights int8|int4`` loads it."""
    torch.manual_seed(0)
    model = Transformer(config_of(shape)).to(DTYPES[dtype]).eval()
    if dtype == "fp8":
        from dsv3.infer.fp8_weights import to_fp8_weights

        model = to_fp8_weights(model)
    elif dtype in ("int8", "int4"):
        from dsv3.kernels.int_weights import to_int_weights

        model = to_int_weights(model, int(dtype[3:]))
    return model


# ---- the worker: one side, one configuration -------------------------------------------------------------


def profiling_kernels() -> object | None:
    """This side's kernels built with the phase timers (and used from now on), or None when its source
    has no timers."""
    import dsv3.kernels.decode_kernels as dk
    from dsv3.kernels import c_build

    if "DSV3_BLOCK_PROFILE" not in dk.SOURCE.read_text():
        return None
    target = Path(tempfile.mkdtemp()) / "profile.so"
    c_build.build(target, dk.SOURCE, ("-DDSV3_BLOCK_PROFILE",))
    lib = dk._declare(ctypes.CDLL(str(target)))
    dk._load = functools.cache(lambda: (lib, "ok"))  # a cache, as the original: callers ask whether it ran
    dk._load()
    return lib


def avx2_only() -> None:
    """This side's kernels on their AVX2 paths (the switches its source has)."""
    import dsv3.kernels.decode_kernels as dk
    from dsv3.kernels import int_weights

    int_weights.avx512(False)
    dk.bf16_dots(False)
    if hasattr(dk, "amx"):
        dk.amx(False)


def worker(shape: str, dtype: str, threads: int, ctx: int, rows: int, phases: bool, tokens: int,
           avx2: bool = False) -> None:
    """Prefill, then answer each line "N" on stdin with the seconds N decode steps took (and the block
    kernel's phase seconds), as one JSON line; end at "quit". ``tokens``: the most steps it will be asked
    for (the engine sizes each row's cache for its request's new tokens)."""
    from dsv3.infer.engine import Engine, Request

    torch.set_num_threads(threads)
    lib = profiling_kernels() if phases else None
    if avx2:
        avx2_only()
    model = random_model(shape, dtype)
    engine = Engine(model, eos_token_ids=frozenset(), fast=True)
    gen = torch.Generator().manual_seed(ctx)
    prompts = [torch.randint(0, model.config.vocab_size, (ctx,), generator=gen).tolist() for _ in range(rows)]
    clock = (ctypes.c_double * 16)()
    with torch.inference_mode():
        batch = engine.start([Request(p, tokens + WARM_UP + 8) for p in prompts])  # the prefill makes one
        for _ in range(WARM_UP):  # the first steps after prefill are slower
            batch.step()
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                return
            steps = int(line)
            for _ in range(TURN_WARM_UP):
                batch.step()
            if lib is not None:  # the phases of the timed steps only
                lib.dsv3_block_profile(clock, 1)
            t0 = time.perf_counter()
            for _ in range(steps):
                failed = [ev.error for ev in batch.step() if ev.error]
                if failed or not batch.rows:
                    raise DSV3Error(f"a decode step ended the batch: {failed or 'no rows left'}")
            answer = {"seconds": (time.perf_counter() - t0) / steps}
            if lib is not None:
                lib.dsv3_block_profile(clock, 1)
                answer["phases"] = [clock[i] / steps for i in range(len(PHASES))]
            print(json.dumps(answer), flush=True)


# ---- the parent ------------------------------------------------------------------------------------------


class Side:
    """A worker process running one source tree (``src``) for one configuration."""

    def __init__(self, src: Path, shape: str, dtype: str, threads: int, ctx: int, rows: int, phases: bool,
                 tokens: int, avx2: bool = False):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, __file__, "--worker", shape, dtype, str(threads), str(ctx), str(rows), str(tokens)]
        cmd += ["--phases"] if phases else []
        cmd += ["--avx2"] if avx2 else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.answer()  # ready

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise DSV3Error(f"a benchmark worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, steps: int) -> dict:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def measure(sources: dict[str, Path], dtype: str, threads: int, ctx: int, rows: int, args) -> dict[str, dict]:
    """Median seconds per step (and phase medians) of each side, the sides taking turns."""
    tokens = args.rounds * (args.steps + TURN_WARM_UP)
    sides = {name: Side(src, args.preset, dtype, threads, ctx, rows, args.phases, tokens, args.avx2)
             for name, src in sources.items()}
    try:
        answers = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, side in sides.items():
                time.sleep(TURN_PAUSE_S)
                answers[name].append(side.run(args.steps))
    finally:
        for side in sides.values():
            side.close()
    out = {}
    for name, runs in answers.items():
        out[name] = {"seconds": statistics.median(r["seconds"] for r in runs)}
        if all("phases" in r for r in runs):
            columns = zip(*(r["phases"] for r in runs), strict=True)
            out[name]["phases_ms"] = {p: 1000 * statistics.median(c) for p, c in zip(PHASES, columns, strict=True)}
    return out


def export(rev: str, folder: Path) -> Path:
    """The ``src`` folder of git revision ``rev``, written under ``folder``."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=REPO, capture_output=True, check=False)
    if archive.returncode != 0:
        raise DSV3Error(f"--baseline-rev {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), "--phases" in sys.argv,
               int(sys.argv[7]), "--avx2" in sys.argv)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from dsv3.option_lists import parse_list
    from serve_scaling import parse_ints

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default="HEAD", help="git revision whose src is the baseline")
    ap.add_argument("--preset", default="small", help="the model's shape (random weights): a config preset or "
                    "decode_speed.py's large")
    ap.add_argument("--contexts", default="256,2048,4096")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1", help="rows per decode step (each its own prompt)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--phases", action="store_true", help="time dsv3_decode_block's phases (profiling builds)")
    ap.add_argument("--avx2", action="store_true", help="both sides on the kernels' AVX2 paths")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        contexts, threads = parse_ints(args.contexts, "--contexts"), parse_ints(args.threads, "--threads")
        batches, dtypes = parse_ints(args.batches, "--batches"), parse_list(args.dtypes, "--dtypes")
        if any(d not in DTYPES for d in dtypes):
            raise DSV3Error(f"--dtypes: each one of {', '.join(DTYPES)}, got {args.dtypes!r}")
        config_of(args.preset)  # an unknown name ends here, naming the known ones
        if args.steps < 1 or args.rounds < 1:
            raise DSV3Error("--steps and --rounds must be >= 1")
        with tempfile.TemporaryDirectory() as tmp:
            sources = {f"baseline ({args.baseline_rev})": export(args.baseline_rev, Path(tmp)),
                       "this tree": REPO / "src"}
            result = run(sources, dtypes, threads, batches, contexts, args)
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, indent=1) if args.json else report(result, list(sources)))


def run(sources: dict[str, Path], dtypes: list[str], threads: list[int], batches: list[int], contexts: list[int],
        args) -> dict:
    from decode_speed import add_roofline, cache_bytes_per_token, figure, read_bandwidth, weight_bytes_per_token

    bandwidth = {t: read_bandwidth(t) for t in threads}
    rows = []
    for dtype in dtypes:
        model = random_model(args.preset, dtype)
        for t in threads:
            for b in batches:
                weights = weight_bytes_per_token(model, b)
                for ctx in contexts:
                    log(f"{dtype}, {t} thread(s), batch {b}, context {ctx}")
                    result = measure(sources, dtype, t, ctx, b, args)
                    bandwidth[t] = max(bandwidth[t], read_bandwidth(t, 128, 3))
                    row = {"dtype": dtype, "threads": t, "batch": b, "context": ctx}
                    for name, r in result.items():  # the engine's cache takes the model's dtype
                        cache = cache_bytes_per_token(model.config, ctx, DTYPES[dtype].itemsize)
                        row[name] = figure(r["seconds"], weights, cache, t, b)
                        if "phases_ms" in r:
                            row[name]["phases_ms"] = r["phases_ms"]
                    rows.append(row)
    add_roofline(rows, bandwidth)
    names = list(sources)
    for row in rows:
        row["time_ratio"] = row[names[1]]["ms_per_step"] / row[names[0]]["ms_per_step"]
    return {"baseline_rev": args.baseline_rev, "simd": "avx2" if args.avx2 else "native",
            "read_bandwidth_gb_s": {t: b / 1e9 for t, b in bandwidth.items()},
            "steps": args.steps, "rounds": args.rounds, "rows": rows}


def report(result: dict, names: list[str]) -> str:
    lines = [f"read bandwidth (GB/s): {result['read_bandwidth_gb_s']}",
             "dtype threads batch context | " + " | ".join(f"{n}: ms/step tokens/s (roofline)" for n in names)
             + " | time ratio (this tree / baseline)"]
    for row in result["rows"]:
        cells = [f"{row[n]['ms_per_step']:.2f} {row[n]['tokens_per_s']:.1f} ({row[n]['roofline_fraction']:.2f})"
                 for n in names]
        lines.append(f"{row['dtype']} {row['threads']} {row['batch']} {row['context']} | " + " | ".join(cells)
                     + f" | {row['time_ratio']:.3f}")
        for n in names:
            if "phases_ms" in row[n]:
                lines.append(f"    {n} phases (ms/step): "
                             + " ".join(f"{p}={v:.3f}" for p, v in row[n]["phases_ms"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
