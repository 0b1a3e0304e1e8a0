"""Dual micro-batch decode in an expert-parallel serving group: how much of the expert exchanges' time the
second micro-batch hides.

``world`` gloo processes on this machine each hold 1/world of every MoE layer's routed experts and decode a
batch of ``rows`` rows of their own (random prompts, random weights of a preset), all through the serving
lockstep (``dsv3.infer.cluster``). Modes alternate step by step on the same batches (single, dual, single,
...), so that load on the machine hits both alike; ``repeats`` batches. Per batch and mode: the median
decode step of the group and the time each rank waits on the exchanges (blocked on an all-to-all of a
dispatch or combine, or in a round's gather); single mode's waiting is what dual mode can hide:

    hidden share = (step single - step dual) / waiting single

computed per batch (the two modes' steps were interleaved) and reported as the median over batches.

Dual mode also runs each layer's compute on half the rows (smaller matrix products, twice the calls) and
issues twice the collectives, so the share is net of those costs; on a machine whose cores the
collectives' threads share with compute it may be small or negative. ``--wire-latency-ms D`` emulates a
network instead (every all-to-all of the exchanges completes no sooner than D ms after its launch, a sleep
that costs no CPU): what the overlap hides when the wire, not the CPU, is what a step waits on. The
table also gives the waiting dual mode removes, (waiting single - waiting dual) / waiting single: the
overlap itself, before the split's extra compute and collectives are paid.

    .venv/bin/python benchmarks/serve_dual_microbatch.py [--preset nano] [--rows 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics


def measure(preset: str, world: int, rows: int, prompt_len: int, steps: int, repeats: int,
            wire_latency_ms: float = 0.0) -> dict:
    from dsv3.testing.launch import launch
    from dsv3.testing.serve_dual_scenarios import decode_step_times

    per_rank = launch(decode_step_times, world, (preset, rows, prompt_len, steps, repeats, wire_latency_ms / 1e3),
                      timeout_s=900)

    def group(key: str) -> list[float]:  # per batch: the mean over ranks (they step together)
        return [statistics.mean(r[key][i] for r in per_rank) for i in range(repeats)]

    series = {key: group(key) for key in ("single_s", "dual_s", "single_wait_s", "dual_wait_s")}
    hidden = [(s - d) / w for s, d, w in zip(series["single_s"], series["dual_s"], series["single_wait_s"],
                                             strict=True) if w > 0]
    med = {key: statistics.median(v) for key, v in series.items()}
    return {"preset": preset, "world": world, "rows_per_rank": rows, "prompt_len": prompt_len,
            "wire_latency_ms": wire_latency_ms, "steps": steps, "repeats": repeats,
            "step_single_s": med["single_s"], "step_dual_s": med["dual_s"],
            "wait_single_s": med["single_wait_s"], "wait_dual_s": med["dual_wait_s"],
            "hidden_share": statistics.median(hidden) if hidden else None, "hidden_share_by_batch": hidden,
            "waiting_removed": (med["single_wait_s"] - med["dual_wait_s"]) / med["single_wait_s"],
            "dual_over_single": statistics.median(d / s for s, d in zip(series["single_s"], series["dual_s"],
                                                                           strict=True)),
            "by_batch": series}


def table(r: dict) -> str:
    hidden = "n/a" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.1f}%"
    lines = [f"dual micro-batch decode: {r['world']} gloo ranks, preset {r['preset']}, {r['rows_per_rank']} rows "
             f"per rank",
             *([f"emulated network: {r['wire_latency_ms']:g} ms latency per all-to-all"] if r["wire_latency_ms"]
               else []),
             f"prompts of {r['prompt_len']} tokens; {r['repeats']} batches, {r['steps']} steps of each mode",
             "per batch, modes alternating step by step; medians",
             "",
             f"{'mode':<28}{'step (ms)':>12}{'waiting (ms)':>15}{'the rest (ms)':>16}"]
    for mode, flag in (("single", 1), ("dual", 2)):
        step, wait = r[f"step_{mode}_s"], r[f"wait_{mode}_s"]
        lines.append(f"{f'{mode} (--micro-batches {flag})':<28}{1e3 * step:>12.1f}{1e3 * wait:>15.1f}"
                     f"{1e3 * (step - wait):>16.1f}")
    lines += ["",
              "waiting: blocked on the exchanges' all-to-alls and the rounds' gathers",
              f"communication hidden: {hidden} = (single - dual) / waiting single",
              f"waiting removed: {100 * r['waiting_removed']:.1f}% = (waiting single - dual) / waiting single",
              "by batch: " + " ".join(f"{100 * h:.0f}%" for h in r["hidden_share_by_batch"]),
              f"dual / single step time: x{r['dual_over_single']:.3f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows decoded per rank")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps of each mode per batch")
    parser.add_argument("--repeats", type=int, default=5, help="batches (each prefilled afresh)")
    parser.add_argument("--wire-latency-ms", type=float, default=0.0,
                        help="emulate a network: each all-to-all completes no sooner than this after its launch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.preset, args.world, args.rows, args.prompt_len, args.steps, args.repeats,
                     args.wire_latency_ms)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()
