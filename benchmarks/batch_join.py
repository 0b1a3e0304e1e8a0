"""What a long prompt joining a running batch costs the streams already in it, and where the decode loop runs.

Three figures on the ``small`` shape (``--layers`` layers, random weights, bf16, ``--threads`` threads):

* ``merge_ms``: merging a ``--long``-token row (prefilled by ``ChunkedPrefill``, as the server does) into a
  batch of ``--streams`` decoding rows (``dsv3.infer.engine.merged``): remapping the page tables (before the
  cache was paged: the new cache's allocation and copies);
* ``step_ms_before`` / ``step_ms_after``: the median decode step of the streams alone, and of the streams
  with the long row beside them (each row attends over its own slots only when the attention skips what
  its mask hides);
* ``step_ms_main_thread`` / ``step_ms_other_thread``: the median decode step of one row run from the main
  thread and from another thread (libgomp's barriers at ``--threads`` > 1; ``dsv3 serve`` decodes on the main
  thread).

    .venv/bin/python benchmarks/batch_join.py --json > /tmp/join.json

Runs against another revision's code too (``PYTHONPATH=DIR/src`` for a ``git archive`` of it): it uses only
interfaces that revision 3335a47 already had.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time

import torch

from dsv3.config import preset
from dsv3.infer.chunked_prefill import ChunkedPrefill
from dsv3.infer.engine import Engine, Request, merged
from dsv3.model import Transformer


def median_step_ms(batch, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def streams(engine: Engine, n: int, new_tokens: int):
    batch = engine.start([Request(prompt_ids=[5 + i] * 16, max_new_tokens=new_tokens, ignore_eos=True)
                          for i in range(n)])
    median_step_ms(batch, 20)  # warm-up
    return batch


def join(engine: Engine, args) -> dict:
    batch = streams(engine, args.streams, 4 * args.steps + 40)
    before = median_step_ms(batch, args.steps)
    long = Request(prompt_ids=[(7 * i) % 16000 + 2 for i in range(args.long)], max_new_tokens=args.steps + 8,
                   ignore_eos=True)
    work = ChunkedPrefill(engine, long, 64)
    fresh = None
    while fresh is None:
        fresh = work.advance()
    t0 = time.perf_counter()
    batch = merged(batch, fresh)
    merge_ms = (time.perf_counter() - t0) * 1e3
    median_step_ms(batch, 3)  # the first steps after the merge (page faults of the new cache)
    return {"merge_ms": merge_ms, "step_ms_before": before, "step_ms_after": median_step_ms(batch, args.steps)}


def threads(engine: Engine, args) -> dict:
    out = {}

    def run(key: str) -> None:
        out[key] = median_step_ms(streams(engine, 1, 2 * args.steps + 40), args.steps)

    run("step_ms_main_thread")
    other = threading.Thread(target=run, args=("step_ms_other_thread",))
    other.start()
    other.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long", type=int, default=4000, help="tokens of the joining prompt")
    ap.add_argument("--steps", type=int, default=50, help="steps per median")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("small"), num_hidden_layers=args.layers, num_nextn_predict_layers=0,
                              torch_dtype="bfloat16")
    engine = Engine(Transformer(cfg).to(torch.bfloat16))
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"},
              "load_average_1min_before": os.getloadavg()[0], **join(engine, args), **threads(engine, args)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        if key != "config":
            print(f"{key:>26} {value:9.2f}")


if __name__ == "__main__":
    main()
