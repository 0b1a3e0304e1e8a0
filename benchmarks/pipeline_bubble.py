"""Pipeline bubble per schedule on gloo CPU processes, next to the DualPipe README's formulas.

For P pipeline ranks and M micro-batches, every schedule of `torch.distributed.pipelining` that dsv3
drives (1F1B, interleaved 1F1B, ZBV, DualPipeV, and DualPipeV with its OVERLAP_F_B pairs run through the
registered custom function) trains a nano-shaped model for a few steps. Measured bubble: 1 - (sum over
ranks of the time spent in stage compute) / (P x step wall time). Formula: (PP-1)(F+B) for 1F1B and
(PP/2-1)(F&B+B-3W) for DualPipeV, with F, B, W timed on the same stages in this process. Also: the peak
bytes of tensors saved for backward on each rank. With --ep E (P x E processes) each stage's routed
experts are split over E replicas, and the DualPipeV row alternates in-order and concurrent OVERLAP_F_B
steps to report the share of all-to-all time hidden (comm_hidden_share). Timings on a shared CPU are noisy;
give the ranks their own cores (P x E <= cores) for meaningful numbers.

    .venv/bin/python benchmarks/pipeline_bubble.py --pp 2 --micro-batches 8 --json
    .venv/bin/python benchmarks/pipeline_bubble.py --pp 2 --ep 2 --micro-batches 8 --schedules 1f1b,dualpipev
"""

from __future__ import annotations

import argparse
import json
import sys

from dsv3.errors import DSV3Error
from dsv3.parallel.pipeline import SCHEDULES
from dsv3.parallel.pipeline_bench import BubbleSpec, run_bubble_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism inside each stage (pp x ep processes)")
    ap.add_argument("--micro-batches", dest="microbatches", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--no-overlap-row", action="store_true", help="skip DualPipeV with the OVERLAP_F_B function")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-len", dest="seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    common = dict(pp=args.pp, microbatches=args.microbatches, micro_batch=args.micro_batch, seq=args.seq,
                  layers=args.layers, hidden=args.hidden, steps=args.steps, ep=args.ep)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    specs = [BubbleSpec(s, **common) for s in schedules]
    if "dualpipev" in schedules and not args.no_overlap_row and args.ep == 1:
        specs.append(BubbleSpec("dualpipev", overlap=True, **common))
    try:
        for spec in specs:
            spec.plan()  # refuses impossible layouts before any process starts
        report = run_bubble_bench(specs, args.timeout)
    except DSV3Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(report))
        return
    print(f"P={args.pp} ranks, M={args.microbatches} micro-batches of {args.micro_batch} x {args.seq} tokens, "
          f"{args.layers} layers, width {args.hidden} (gloo, CPU)")
    print(f"{'schedule':<20} {'measured':>9} {'formula':>9} {'F ms':>7} {'B ms':>7} {'W ms':>7} "
          f"{'step ms':>8} {'hidden':>7}  peak saved MB per rank")
    for row in report["rows"]:
        name = row["schedule"] + (" +OVERLAP_F_B" if row["overlap_f_b_registered"] else "")
        formula = "-" if row["formula_bubble"] is None else f"{row['formula_bubble']:.3f}"
        peaks = " ".join(f"{b / 2**20:.1f}" for b in row["peak_saved_activation_bytes_per_rank"])
        hidden = "-" if row.get("comm_hidden_share") is None else f"{row['comm_hidden_share']:.2f}"
        print(f"{name:<20} {row['measured_bubble']:>9.3f} {formula:>9} {row['F_s'] * 1e3:>7.2f} "
              f"{row['B_s'] * 1e3:>7.2f} {row['W_s'] * 1e3:>7.2f} {row['step_wall_s'] * 1e3:>8.1f} "
              f"{hidden:>7}  {peaks}")


if __name__ == "__main__":
    main()
