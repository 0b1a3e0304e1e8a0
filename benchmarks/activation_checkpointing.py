"""Activation checkpointing's memory and cost: `dsv3 train ... --steps 3` per `--ac` mode (the real command, a
fresh process each), then RUN/run.json's peak saved activations (measured over the first step), the three
steps' losses and gradient norms (equal across the modes) and the last step's tokens/s.

    .venv/bin/python benchmarks/activation_checkpointing.py            # nano, seq 512, batch 2
    .venv/bin/python benchmarks/activation_checkpointing.py --json     # one JSON object

``activations_peak`` counts the tensors saved for backward from the forward into the backward (deterministic:
one run is the figure). Under ``--ac`` a region's recomputation also holds the region's saved tensors while
its backward runs, one region at a time: ``largest_region`` is the most one region of the mode saves (a
block for full, an MLA for selective; counted on the plain model), so ``activations_peak + largest_region``
bounds the peak with that transient. The Markdown table gives both as a fraction of ``--ac none``'s peak.
The JSON also has the last step's tokens/s (one step on a shared machine: noisy)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("none", "selective", "full")
MIB = 2**20


def train_step(mode: str, out: Path, args) -> dict:
    """Three training steps under ``--ac mode``: run.json's memory, the losses and the last step's speed."""
    cmd = [sys.executable, "-m", "dsv3", "train", "--preset", args.preset, "--data", args.data, "--steps", "3",
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--eval-tokens", "512",
           "--device", "cpu", "--threads", str(args.threads), "--ac", mode, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode:
        sys.exit(f"error: --ac {mode} failed:\n{proc.stderr[-2000:]}")
    (memory,) = json.loads((out / "run.json").read_text())["memory"]["per_rank"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    return {"activations_peak": memory["activations_peak"], "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows], "tokens_per_s": rows[-1]["tokens_per_s"]}


def largest_region(args, mode: str) -> int:
    """The most bytes one of ``mode``'s regions saves for its backward (what its recomputation holds), at
    this batch and sequence length: a forward of the plain model with a meter around each region."""
    import torch

    from dsv3.config import preset
    from dsv3.model.transformer import Transformer
    from dsv3.parallel.memory import SavedTensorMeter
    from dsv3.train.activation_checkpointing import checkpoint_regions

    torch.manual_seed(0)
    model = Transformer(preset(args.preset)).train()
    active, peaks = {}, []

    def enter(module, inputs):
        meter = SavedTensorMeter()
        active[id(module)] = (meter, meter.active())
        active[id(module)][1].__enter__()

    def leave(module, inputs, output):
        meter, context = active.pop(id(module))
        context.__exit__(None, None, None)
        peaks.append(meter.peak)

    for region in checkpoint_regions(model, mode):
        region.register_forward_pre_hook(enter)
        region.register_forward_hook(leave)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len))
    model.loss(ids, ids)
    return max(peaks, default=0)


def table(result: dict) -> str:
    none = result["modes"]["none"]["activations_peak"]
    rows = ["| --ac | peak saved activations (MiB) | x none | with its largest region recomputed (MiB) | x none | "
            "loss after step 3 |", "|---|---|---|---|---|---|"]
    for mode, m in result["modes"].items():
        peak = m["activations_peak"]
        bound = peak + m["largest_region"]
        rows.append(f"| {mode} | {peak / MIB:.2f} | {peak / none:.2f} | {bound / MIB:.2f} | {bound / none:.2f} | "
                    f"{m['losses'][-1]:.6f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "src" / "dsv3"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            print(f"--ac {mode} ...", file=sys.stderr, flush=True)
            modes[mode] = {**train_step(mode, Path(tmp) / mode, args), "largest_region": largest_region(args, mode)}
    losses = {(tuple(m["losses"]), tuple(m["grad_norms"])) for m in modes.values()}
    result = {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size, "modes": modes,
              "same_losses_and_grad_norms": len(losses) == 1}
    print(json.dumps(result) if args.json else table(result) + f"\n\nlosses and gradient norms equal in every mode: "
          f"{result['same_losses_and_grad_norms']}")


if __name__ == "__main__":
    main()
