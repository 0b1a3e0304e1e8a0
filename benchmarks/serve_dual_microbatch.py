"""Dual micro-batch decode in an expert-parallel serving group: how much of the expert exchanges' time the
second micro-batch hides.

``world`` gloo processes on this machine each hold 1/world of every MoE layer's routed experts and decode a
batch of ``rows`` rows of their own (random prompts, random weights of a preset), all through the serving
lockstep (``dsv3.infer.cluster``). Modes alternate step by step on the same batches (single, dual, single,
...), so that load on the machine hits both alike; ``repeats`` batches. Per batch and mode: the median
decode step of the group; in single mode also the time each rank spends in the exchanges (dispatch and
combine, the rounds' gathers included), which is what dual mode can hide:

    hidden share = (step single - step dual) / exchange time single

computed per batch (the two modes' steps were interleaved) and reported as the median over batches.

Dual mode also runs each layer's compute on half the rows (smaller matrix products, twice the calls), so
the share is net of that cost; on a machine whose cores the collectives' threads share with compute it may
be small or negative.

    .venv/bin/python benchmarks/serve_dual_microbatch.py [--preset nano] [--rows 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics


def measure(preset: str, world: int, rows: int, prompt_len: int, steps: int, repeats: int) -> dict:
    from dsv3.testing.launch import launch
    from dsv3.testing.serve_dual_scenarios import decode_step_times

    per_rank = launch(decode_step_times, world, (preset, rows, prompt_len, steps, repeats), timeout_s=900)

    def group(key: str) -> list[float]:  # per repeat: the mean over ranks (they step together)
        return [statistics.mean(r[key][i] for r in per_rank) for i in range(repeats)]

    singles, duals, exchanges = (group(k) for k in ("single_s", "dual_s", "exchange_s"))
    hidden = [(s - d) / e for s, d, e in zip(singles, duals, exchanges, strict=True) if e > 0]
    single, dual, exchange = (statistics.median(v) for v in (singles, duals, exchanges))
    return {"preset": preset, "world": world, "rows_per_rank": rows, "prompt_len": prompt_len,
            "steps": steps, "repeats": repeats, "step_single_s": single, "step_dual_s": dual,
            "exchange_single_s": exchange, "exchange_share_single": exchange / single,
            "hidden_share": statistics.median(hidden) if hidden else None,
            "hidden_share_by_repeat": hidden,
            "speedup": statistics.median(s / d for s, d in zip(singles, duals, strict=True)),
            "single_by_repeat_s": singles, "dual_by_repeat_s": duals, "exchange_by_repeat_s": exchanges}


def table(r: dict) -> str:
    hidden = "n/a" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.1f}%"
    lines = [f"dual micro-batch decode: {r['world']} gloo ranks, preset {r['preset']}, {r['rows_per_rank']} rows "
             f"per rank",
             f"prompts of {r['prompt_len']} tokens; {r['repeats']} batches, {r['steps']} steps of each mode",
             "per batch, modes alternating step by step; medians",
             "",
             f"{'mode':<28}{'step (ms)':>14}{'exchanges (ms)':>18}{'share':>10}",
             f"{'single (--micro-batches 1)':<28}{1e3 * r['step_single_s']:>14.1f}"
             f"{1e3 * r['exchange_single_s']:>18.1f}{100 * r['exchange_share_single']:>9.1f}%",
             f"{'dual (--micro-batches 2)':<28}{1e3 * r['step_dual_s']:>14.1f}",
             "",
             f"communication hidden: {hidden} = (single - dual) / exchanges single",
             "by batch: " + " ".join(f"{100 * h:.0f}%" for h in r["hidden_share_by_repeat"]),
             f"dual / single step time: x{1 / r['speedup']:.3f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows decoded per rank")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps of each mode per batch")
    parser.add_argument("--repeats", type=int, default=5, help="batches (each prefilled afresh)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.preset, args.world, args.rows, args.prompt_len, args.steps, args.repeats)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()
