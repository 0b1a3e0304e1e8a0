"""What integer weights (``--weights int8|int4``) cost a trained model: held-out bits per byte, measured
as `dsv3 train` measures it (the run's held-out split of its corpus, its tokenizer, its evaluation windows), and
the logits' relative RMS error against the same model in bf16, for each weight format.

    .venv/bin/python benchmarks/int_weights_error.py --model runs/quickstart/latest --json

Rows: ``fp32`` (the checkpoint as trained), ``bf16`` (the reference of the error column), ``fp8`` (128x128
blocks), ``int8`` and ``int4`` (experts, MLPs and attention projections as groups of 32, the head at 8 bits,
the rest as in bf16). Every row but fp32 computes in bf16, so the error column is what the weights alone
change. Default data: what ``dsv3 train`` learns from by default (the Python standard library), split with the
run's --val-fraction.

With ``--llama-convert`` (llama.cpp's ``convert_hf_to_gguf.py``; ``benchmarks/llama_cpp_setup.sh --env`` sets it
and ``--llama-quantize``), the same model exported to the HF layout and converted by llama.cpp's own tools runs
the same held-out windows: rows ``llama.cpp bf16``, ``llama.cpp q8_0`` and ``llama.cpp q4_0`` (its
``llama-quantize`` from the f32 GGUF), each quantized row's logits' error against ``llama.cpp bf16`` (its own
bf16, as dsv3's rows are against dsv3's): llama.cpp's Q8_0 and Q4_0 quantize every matrix (its Q4_0 files keep
the head at 6 bits), dsv3's int8 and int4 every one but ``kv_b_proj`` (the head at 8 bits).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
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
    from dsv3.parallel.parallelize import parallelize
    from dsv3.train.distributed import World
    from dsv3.train.evaluate import evaluate

    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    # evaluate takes the model under its layout (here one process), as dsv3 train hands it over
    result = evaluate(parallelize(model), val, windows, token_bytes, world, 8, contextlib.nullcontext())
    with torch.no_grad():
        logits = model(val.batch(windows[:4])[0]).float()
    row = {"val_bpb": result["val_bpb"], "val_loss": result["val_loss"], "val_tokens": result["val_tokens"]}
    if reference_logits is not None:
        row["logits_relative_rms_error"] = float((logits - reference_logits).norm() / reference_logits.norm())
        row["argmax_agreement"] = float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean())
    return row, logits


def llama_rows(folder: Path, val, windows: list[int], token_bytes, converter: str, quantizer: str | None,
               work: Path) -> dict:
    """llama.cpp's rows on the same windows (loss and bits per byte as ``evaluate`` counts them: every labelled
    next token), its bf16 GGUF the reference of its quantized rows' logits (the first 4 windows'), or {} when
    llama.cpp is not usable here (``decode_speed.gguf_files`` says why)."""
    import numpy as np
    import torch.nn.functional as F

    from decode_speed import LlamaCpp, gguf_files, repack_runs  # the benchmarks folder is sys.path[0]
    from dsv3.convert import convert_checkpoint
    from dsv3.data.packing import IGNORE_INDEX

    hf = work / "hf"
    convert_checkpoint(folder, hf, "hf")
    ggufs = gguf_files(str(hf), converter, work, quantizer)
    rows, reference = {}, None
    for outtype in ("bf16", "q8_0", "q4_0"):
        if outtype not in ggufs:
            continue
        impl = LlamaCpp(ggufs[outtype], 1, val.seq_len + 8, 0, repack_runs(ggufs[outtype]), logits_all=True)
        llm = impl.llm
        nats, n_bytes, n_tokens, first = 0.0, 0, 0, []
        for w in windows:
            inputs, labels = val.batch([w])
            llm.reset()
            llm.eval(inputs[0].tolist())
            logits = torch.from_numpy(np.array(llm.scores[: inputs.shape[1]], dtype=np.float32))
            nats += float(F.cross_entropy(logits, labels[0], reduction="sum", ignore_index=IGNORE_INDEX))
            labelled = labels[labels != IGNORE_INDEX].numpy()
            n_bytes, n_tokens = n_bytes + int(token_bytes[labelled].sum()), n_tokens + len(labelled)
            if len(first) < 4:
                first.append(logits)
        logits = torch.stack(first)
        row = {"val_bpb": nats / math.log(2) / max(n_bytes, 1), "val_loss": nats / max(n_tokens, 1),
               "val_tokens": n_tokens, "repacked": impl.repack}
        if reference is None:
            reference = logits
        else:
            row["logits_relative_rms_error"] = float((logits - reference).norm() / reference.norm())
            row["argmax_agreement"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        rows[f"llama.cpp {outtype}"] = row
        del llm, impl
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder with dsv3's own tokenizer")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--data", action="append", help="the run's --data (default: its default corpus)")
    parser.add_argument("--llama-convert", default=os.environ.get("DSV3_LLAMA_CONVERT"), metavar="PATH",
                        help="llama.cpp's convert_hf_to_gguf.py, for its rows (default: $DSV3_LLAMA_CONVERT)")
    parser.add_argument("--llama-quantize", default=os.environ.get("DSV3_LLAMA_QUANTIZE"), metavar="PATH",
                        help="llama.cpp's llama-quantize, for its Q4_0 row (default: $DSV3_LLAMA_QUANTIZE)")
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
    if args.llama_convert:
        with tempfile.TemporaryDirectory() as work:
            rows.update(llama_rows(folder, val, windows, token_bytes, args.llama_convert, args.llama_quantize,
                                   Path(work)))
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
