"""What integer expert weights (``--weights int8|int4``) cost a trained model: held-out bits per byte, measured
as `dsv3 train` measures it (the run's held-out split of its corpus, its tokenizer, its evaluation windows), and
the logits' relative RMS error against the same model in bf16, for each weight format.

    .venv/bin/python benchmarks/int_weights_error.py --model runs/quickstart/latest --json

Rows: ``fp32`` (the checkpoint as trained), ``bf16`` (the reference of the error column), ``fp8`` (128x128
blocks), ``int8`` and ``int4`` (routed and shared experts as groups of 32, the rest as in bf16). Every row
but fp32 computes in bf16, so the error column is what the weights alone change. Default data: what
``dsv3 train`` learns from by default (the Python standard library), split with the run's --val-fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch


def held_out(folder: Path, seq_len: int, val_fraction: float, data: list[str] | None):
    """(held-out windows, their indices, UTF-8 bytes per token id), as `dsv3 train` builds them."""
    from tokenizers import Tokenizer

    from dsv3.data.corpus import load_corpus
    from dsv3.data.packing import PackedSequences
    from dsv3.data.tokenizer import default_cache_dir, own_tokenizer, token_byte_lengths, tokenize_corpus

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    streams = tokenize_corpus(load_corpus(data, val_fraction), own_tokenizer(tokenizer), default_cache_dir())
    val = PackedSequences(streams.val, min(seq_len, len(streams.val) - 1), streams.val_mask)
    return val, token_byte_lengths(tokenizer)


def measure(model, val, windows, token_bytes, reference_logits=None) -> tuple[dict, torch.Tensor]:
    from dsv3.train.distributed import World
    from dsv3.train.evaluate import evaluate

    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    result = evaluate(model, val, windows, token_bytes, world, 8, contextlib.nullcontext())
    with torch.no_grad():
        logits = model(val.batch(windows[:4])[0]).float()
    row = {"val_bpb": result["val_bpb"], "val_loss": result["val_loss"], "val_tokens": result["val_tokens"]}
    if reference_logits is not None:
        row["logits_relative_rms_error"] = float((logits - reference_logits).norm() / reference_logits.norm())
        row["argmax_agreement"] = float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean())
    return row, logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder with dsv3's own tokenizer")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--data", action="append", help="the run's --data (default: its default corpus)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dsv3.infer.loading import load_model, with_weights
    from dsv3.train.evaluate import eval_windows

    torch.set_num_threads(1)
    folder = Path(args.model).resolve()
    val, token_bytes = held_out(folder, args.seq_len, args.val_fraction, args.data)
    windows = eval_windows(val, args.eval_tokens)
    rows = {"fp32": measure(load_model(folder, torch.float32), val, windows, token_bytes)[0]}
    rows["bf16"], reference = measure(load_model(folder, torch.bfloat16), val, windows, token_bytes)
    for weights in ("fp8", "int8", "int4"):
        model = with_weights(load_model(folder, torch.bfloat16), weights)
        rows[weights] = measure(model, val, windows, token_bytes, reference)[0]
    result = {"model": str(args.model), "rows": rows, "windows": len(windows), "seq_len": val.seq_len,
              "logits_compared": "the first 4 held-out windows' logits"}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'weights':<8} {'bits/byte':>9} {'vs bf16':>8} {'logit rel RMS':>14} {'argmax agree':>13}")
        base = rows["bf16"]["val_bpb"]
        for name, row in rows.items():
            err = row.get("logits_relative_rms_error")
            agree = row.get("argmax_agreement")
            print(f"{name:<8} {row['val_bpb']:>9.4f} {row['val_bpb'] - base:>+8.4f} "
                  f"{'' if err is None else f'{err:.4f}':>14} {'' if agree is None else f'{agree:.3f}':>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
