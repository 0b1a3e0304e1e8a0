"""What one prefill chunk costs, by its tokens and by the slots before it, on the two paths a chunk can take:
the model's modules (``Transformer.hidden_states``, what chunks ran through before) and the decode step's
absorbed path (``FastDecode`` with ``absorb=True``, the C kernels: what ``serve --max-prefill-tokens`` runs now);
beside them, a whole prefill's cost per token, and a decode step of ``--rows`` rows. Then ``--prompts``: several
short prompts arriving together, prefilled by the engine on either path (the kernels in calls of at most 64
tokens, rows grouped; the modules in one forward): what ``dsv3.infer.engine.KERNEL_PREFILL_TOKENS`` is set from.

The ``small`` shape with ``--layers`` layers, random weights, bf16, one thread by default (the model of
``benchmarks/chunked_prefill.py``). Each time is the median of ``--repeats`` calls after one warm-up call.

    .venv/bin/python benchmarks/prefill_chunk_cost.py --json > /tmp/chunk_cost.json

prints the table, or the JSON for benchmarks/record_result.py (benchmarks/results/prefill_chunk_cost.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import GREEDY
from dsv3.kernels.decode import FastDecode
from dsv3.model import Transformer, huge_pages
from dsv3.option_lists import parse_list


def prompt_shape(item: str) -> tuple[int, int]:
    """"8x16" -> (8, 16); one clear error for anything else."""
    try:
        B, L = (int(part) for part in item.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --prompts takes B x L items such as 8x16, got {item!r}") from None
    if B < 1 or L < 1:
        raise SystemExit(f"error: --prompts needs B and L >= 1, got {item!r}")
    return B, L


def timed_ms(call, repeats: int) -> float:
    """The median wall time of ``call()`` in ms, after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def build(layers: int) -> tuple[Transformer, FastDecode]:
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("small"), num_hidden_layers=layers, num_nextn_predict_layers=0,
                              torch_dtype="bfloat16", max_position_embeddings=8192)
    model = Transformer(cfg).to(torch.bfloat16).eval()
    huge_pages.move_module(model)  # as the engine does
    return model, FastDecode(model)


def chunk_ms(path, ids: torch.Tensor, pos: torch.Tensor, cache, start: int, repeats: int,
             absorb: bool | None) -> float:
    """One chunk's ms on ``path`` (the modules take the path chunks took before: ``absorb`` None)."""
    return timed_ms(lambda: path(ids, positions=pos, cache=cache, start_pos=start, absorb=absorb), repeats)


@torch.inference_mode()
def chunk_costs(model: Transformer, fast: FastDecode, sizes: list[int], starts: list[int], repeats: int) -> list[dict]:
    """One row per (start, size): the chunk's ms on the modules and on the kernels, and per token."""
    cache = model.new_cache(1, max(starts) + max(sizes), dtype=torch.bfloat16)
    vocab, rows = model.config.vocab_size, []
    for start in starts:
        for size in sizes:
            ids = torch.randint(0, vocab, (1, size))
            pos = torch.arange(start, start + size)[None]
            modules = chunk_ms(model.hidden_states, ids, pos, cache, start, repeats, None)
            kernels = chunk_ms(fast.hidden_states, ids, pos, cache, start, repeats, True)
            rows.append({"start": start, "tokens": size, "modules_ms": modules, "kernels_ms": kernels,
                         "kernels_ms_per_token": kernels / size})
    return rows


@torch.inference_mode()
def references(model: Transformer, fast: FastDecode, prompt: int, rows: int, repeats: int) -> dict:
    """A whole prefill of ``prompt`` tokens (its ms per token) and a decode step of ``rows`` rows with its logits."""
    vocab = model.config.vocab_size
    cache = model.new_cache(1, prompt, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (1, prompt))
    whole = timed_ms(lambda: model.hidden_states(ids, cache=cache, start_pos=0), max(1, repeats // 3))
    step_cache = model.new_cache(rows, 128, dtype=torch.bfloat16)
    step_ids, pos = torch.randint(0, vocab, (rows, 1)), torch.full((rows, 1), 64)
    step = timed_ms(lambda: fast.hidden_and_logits(step_ids, positions=pos, cache=step_cache, start_pos=64), repeats)
    return {"whole_prefill_tokens": prompt, "whole_prefill_ms": whole, "whole_prefill_ms_per_token": whole / prompt,
            "decode_step_rows": rows, "decode_step_ms": step}


@torch.inference_mode()
def prompt_costs(model: Transformer, batches: list[tuple[int, int]], repeats: int) -> list[dict]:
    """One row per B x L: the engine's prefill of B random L-token prompts arriving together (``Engine.start``,
    its first tokens sampled), on the decode step's kernels (rows in groups of at most MAX_KERNEL_ROWS tokens a
    call) and on the model's modules (one forward); ``Engine.kernel_prefill_tokens`` chooses."""
    engine = Engine(model, eos_token_ids=frozenset())
    vocab, rows = model.config.vocab_size, []

    def start(B: int, L: int) -> None:
        engine.start([Request(torch.randint(0, vocab, (L,)).tolist(), 1, GREEDY) for _ in range(B)]).release()

    for B, L in batches:
        times = {}
        for path, limit in (("kernels", 10**9), ("modules", 0)):
            engine.kernel_prefill_tokens = limit
            times[path] = timed_ms(lambda B=B, L=L: start(B, L), repeats)
        rows.append({"prompts": B, "tokens_each": L, "kernels_ms": times["kernels"], "modules_ms": times["modules"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the small shape (default: 4)")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="chunk tokens (default: 1,2,4,8,16,32,64)")
    ap.add_argument("--starts", default="0,2000,3900", help="slots before the chunk (default: 0,2000,3900)")
    ap.add_argument("--prompt", type=int, default=4000, help="the whole prefill's tokens (default: 4000)")
    ap.add_argument("--rows", type=int, default=4, help="the decode step's rows (default: 4)")
    ap.add_argument("--prompts", default="8x16,4x32,16x16,8x32,8x64",
                    help="prompts arriving together, B x L tokens each (default: 8x16,4x32,16x16,8x32,8x64)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes, starts = parse_list(args.sizes, "--sizes", int), parse_list(args.starts, "--starts", int)
    batches = [prompt_shape(item) for item in parse_list(args.prompts, "--prompts")]
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    model, fast = build(args.layers)
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "load_average_1min_before": load,
              "kernels": fast.kernels, **references(model, fast, args.prompt, args.rows, args.repeats),
              "chunks": chunk_costs(model, fast, sizes, starts, args.repeats),
              "prompts": prompt_costs(model, batches, args.repeats)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"whole prefill: {result['whole_prefill_ms_per_token']:.3f} ms per token ({args.prompt:,} tokens); "
          f"decode step of {args.rows} rows: {result['decode_step_ms']:.2f} ms")
    print(f"{'start':>6} {'tokens':>6} {'modules ms':>11} {'kernels ms':>11} {'kernels ms/token':>17}")
    for r in result["chunks"]:
        print(f"{r['start']:>6} {r['tokens']:>6} {r['modules_ms']:>11.1f} {r['kernels_ms']:>11.1f} "
              f"{r['kernels_ms_per_token']:>17.2f}")
    print(f"\nprompts arriving together, prefilled by the engine\n{'prompts':>8} {'tokens':>7} {'modules ms':>11} "
          f"{'kernels ms':>11} {'modules/kernels':>16}")
    for r in result["prompts"]:
        tokens, modules, kernels = r["prompts"] * r["tokens_each"], r["modules_ms"], r["kernels_ms"]
        print(f"{r['prompts']:>8} {tokens:>7} {modules:>11.1f} {kernels:>11.1f} {modules / kernels:>16.2f}")


if __name__ == "__main__":
    main()
