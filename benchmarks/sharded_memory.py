"""Per-rank memory of `dsv3 train` under the layouts of 4 processes, sharded x EP x pipeline: for each layout
one `torchrun --nproc-per-node 4 -m dsv3 train ... --steps 1` (the real command, fresh processes), then rank
0's `memory` from RUN/run.json (bytes of parameters, gradients, AdamW state and peak saved activations,
counted from the tensors: deterministic, so one run is the figure), and the largest rank's parameters +
AdamW state (pipeline stages differ: the last holds the head and the MTP layer).

    .venv/bin/python benchmarks/sharded_memory.py --json      # nano preset on this repository's sources

Prints a Markdown table (MiB, and parameters + AdamW state as a fraction of the replicated run's), or with
--json one JSON
object: per layout, every rank's bytes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "replicated": [],
    "zero1": ["--dp-shard", "zero1"],
    "fsdp": ["--dp-shard", "fsdp"],
    "ep4": ["--ep", "4"],
    "ep2": ["--ep", "2"],
    "ep4 x fsdp": ["--ep", "4", "--dp-shard", "fsdp"],
    "ep2 x fsdp": ["--ep", "2", "--dp-shard", "fsdp"],
    "ep4 x zero1": ["--ep", "4", "--dp-shard", "zero1"],
    "ep2 x zero1": ["--ep", "2", "--dp-shard", "zero1"],
    "pp2": ["--pp", "2"],
    "pp2 x fsdp": ["--pp", "2", "--dp-shard", "fsdp"],
    "pp2 x ep2 x fsdp": ["--pp", "2", "--ep", "2", "--dp-shard", "fsdp"],
    "pp2 x zero1": ["--pp", "2", "--dp-shard", "zero1"],
}
MIB = 2**20


def measure(flags: list[str], out: Path, args) -> list[dict]:
    """Every rank's memory after one training step under ``flags``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "dsv3",
           "train", "--preset", args.preset, "--data", args.data, "--steps", "1", "--batch-size", "4",
           "--seq-len", "128", "--eval-tokens", "128", "--device", "cpu", "--gpus-per-node", "2", "--out",
           str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"error: {' '.join(flags) or 'replicated'} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "run.json").read_text())["memory"]["per_rank"]


def table(results: dict[str, list[dict]]) -> str:
    base = results["replicated"][0]
    whole = base["parameters"] + base["optimizer"]
    rows = ["| layout | parameters | gradients | AdamW state | params + AdamW (x replicated) | largest rank's "
            "params + AdamW | peak saved activations |", "|---|---|---|---|---|---|---|"]
    for name, ranks in results.items():
        m = ranks[0]
        both = m["parameters"] + m["optimizer"]
        largest = max(r["parameters"] + r["optimizer"] for r in ranks)
        rows.append(f"| {name} | {m['parameters'] / MIB:.2f} | {m['gradients'] / MIB:.2f} | "
                    f"{m['optimizer'] / MIB:.2f} | {both / MIB:.2f} (x{both / whole:.2f}) | "
                    f"{largest / MIB:.2f} (x{largest / whole:.2f}) | {m['activations_peak'] / MIB:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "src" / "dsv3"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in LAYOUTS.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[name] = measure(flags, Path(tmp) / name.replace(" ", ""), args)
    print(json.dumps(results) if args.json else table(results))


if __name__ == "__main__":
    main()
