"""How long Python's cyclic garbage collector stalls a process that has loaded a model, before and after
``dsv3.infer.heap.loaded_heap_frozen`` (what ``dsv3 serve`` runs its loop under).

The ``small`` shape (``--layers`` layers, bf16, random weights) is saved to a temporary folder and loaded as
``dsv3 serve`` loads it (an engine with its prefix cache, after one short generation); then each generation's
collection is timed, best of ``--repeats``, with everything loaded tracked by the collector and then frozen.

    .venv/bin/python benchmarks/gc_pause.py --json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from dsv3.infer.cli import attach_prefix_cache, build_engine
from dsv3.infer.engine import Request
from dsv3.infer.heap import loaded_heap_frozen
from serve_vs_engine import save_checkpoint


def collection_ms(repeats: int) -> dict[str, float]:
    """Each generation's collection, best of ``repeats``, in ms."""
    best = {}
    for generation in (0, 1, 2):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            gc.collect(generation)
            times.append(1000 * (time.perf_counter() - t0))
        best[f"gen{generation}_ms"] = min(times)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "small-bf16"
        save_checkpoint(folder, args.layers)
        engine = build_engine(str(folder), "bf16", "native", "auto", "none", threads=1)
        attach_prefix_cache(engine, "1G", 16, None)
        engine.generate([Request([1, 2, 3], 4)])
        result = {"shape": f"small, {args.layers} layers, bf16", "tracked_objects": len(gc.get_objects()),
                  "tracked": collection_ms(args.repeats)}
        with loaded_heap_frozen():
            result["frozen_objects"] = gc.get_freeze_count()
            result["frozen"] = collection_ms(args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    print(f"objects the collector walks: {result['tracked_objects']:,} (frozen: {result['frozen_objects']:,})")
    for key in result["tracked"]:
        print(f"{key}: {result['tracked'][key]:8.2f} tracked  {result['frozen'][key]:8.2f} frozen")


if __name__ == "__main__":
    main()
