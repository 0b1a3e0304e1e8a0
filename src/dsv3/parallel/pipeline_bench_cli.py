"""`dsv3 bench pipeline`: one pipeline schedule on P (x E with --ep) local gloo processes: the measured bubble
next to the DualPipe README's formula, each rank's peak saved-activation bytes, and with --ep under
DualPipeV the share of all-to-all time its overlapped F&B pairs hide (dsv3.parallel.pipeline_bench).

Times are wall-clock on this machine (CPU processes sharing its cores, gloo over loopback): the bubble they
show is the schedule's shape plus this machine's noise, not what a GPU cluster would measure.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from dsv3.errors import DSV3Error
from dsv3.parallel.pipeline import SCHEDULES

MAX_PROCESSES = 16


def main(
    pp: Annotated[int, typer.Option(help="Pipeline ranks (processes).")] = 2,
    schedule: Annotated[str, typer.Option("--pp-schedule",
                                          help=f"Pipeline schedule: one of {', '.join(SCHEDULES)}.")] = "1f1b",
    microbatches: Annotated[int, typer.Option("--micro-batches",
                                              help="Micro-batches per step (default: twice the stages).")] = 0,
    micro_batch: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 2,
    seq: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 64,
    layers: Annotated[int, typer.Option(help="Transformer layers (nano's structure).")] = 8,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128,
    steps: Annotated[int, typer.Option(help="Measured steps (after one warm-up step).")] = 3,
    overlap: Annotated[
        bool, typer.Option(help="dualpipev: run its overlapped F&B pairs through the registered hook.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    ep: Annotated[int, typer.Option(help="Expert parallelism inside each stage: P x E processes.")] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds before a hung run is aborted.")] = 600.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")
    ] = False,
) -> None:
    """Run one pipeline schedule on P gloo processes; report its bubble and saved activations per rank."""
    spec = _spec(pp, schedule, microbatches, micro_batch, seq, layers, hidden, steps, overlap, seed, ep)
    from dsv3.parallel.pipeline_bench import run_bubble_bench

    print(f"running {spec.world} processes ...", file=sys.stderr)
    report = run_bubble_bench([spec], timeout_s=timeout)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        _print_report(report)


def _spec(pp, schedule, microbatches, micro_batch, seq, layers, hidden, steps, overlap, seed, ep=1):
    """A checked BubbleSpec: every bad option is a DSV3Error before any process starts."""
    from dsv3.parallel.pipeline_bench import BubbleSpec

    if not 2 <= pp <= MAX_PROCESSES:
        raise DSV3Error(f"--pp must be 2..{MAX_PROCESSES} processes, got {pp}")
    if ep < 1 or pp * ep > MAX_PROCESSES:
        raise DSV3Error(f"--ep must be at least 1 with --pp x --ep at most {MAX_PROCESSES} processes, got {ep}")
    if schedule not in SCHEDULES:
        raise DSV3Error(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    for name, value in (("micro-batch", micro_batch), ("seq-len", seq), ("layers", layers), ("hidden", hidden),
                        ("steps", steps)):
        if value < 1:
            raise DSV3Error(f"--{name} must be at least 1, got {value}")
    if microbatches < 0:
        raise DSV3Error(f"--micro-batches must be at least 1 (0: the default), got {microbatches}")
    if overlap and schedule != "dualpipev":
        raise DSV3Error(f"--overlap needs --pp-schedule dualpipev, not {schedule}")
    stages = pp * (1 if schedule == "1f1b" else 2)
    spec = BubbleSpec(schedule=schedule, pp=pp, microbatches=microbatches or 2 * stages, micro_batch=micro_batch,
                      seq=seq, layers=layers, hidden=hidden, steps=steps, overlap=overlap, seed=seed, ep=ep)
    spec.config().validate()
    if spec.config().n_routed_experts % ep:
        raise DSV3Error(f"--ep {ep} must divide the model's {spec.config().n_routed_experts} routed experts")
    spec.plan()  # the plan's own checks (micro-batches the schedule accepts, a layer in every stage)
    return spec


def _print_report(report: dict) -> None:
    for row in report["rows"]:
        print(f"{row['schedule']} on {row['pp']} ranks, {row['stages']} stages {row['layers_per_stage']}, "
              f"{row['microbatches']} micro-batches: step {row['step_wall_s']} s")
        print(f"  measured bubble {row['measured_bubble']:.1%} (per step {row['measured_bubble_per_step']})")
        if row["formula"] is not None:
            print(f"  formula {row['formula']}: {row['formula_bubble_s']} s = {row['formula_bubble']:.1%}")
        print(f"  F {row['F_s']} s, B {row['B_s']} s (I {row['I_s']} s + W {row['W_s']} s) per stage and "
              "micro-batch")
        peaks = ", ".join(f"{b / 2**20:.2f} MiB" for b in row["peak_saved_activation_bytes_per_rank"])
        print(f"  peak saved activations per rank: {peaks}")
        if row.get("comm_hidden_share") is not None:
            print(f"  EP{row['ep']} all-to-all hidden by the overlapped F&B pairs: {row['comm_hidden_share']:.1%} "
                  "(mean over ranks)")
