"""What `dsv3 serve` delivers against its own engine's decode step, on the same checkpoint, dtype and threads:
the server's time per output token for one request alone (streamed, and not streamed) against
`dsv3 bench decode`'s step at batch 1, and its output tokens/s at 8 concurrent requests against the
engine's at batch 8 (the goals: at most 1.3x the step, at least 0.8x the tokens/s).

A random-weight checkpoint (the ``small`` shape with ``--layers`` layers and no MTP layer, in bf16: about
120 MB; a tokenizer with a word per token, so that every generated token is a chunk of the stream) is saved
to a temporary folder and served with ``/metrics`` on (its default). Each round runs the engine figures
(`dsv3 bench decode --json`, its own process) and the server figures (`dsv3 bench serve`'s client) back to
back; the ratios compare each figure's best round (a busy machine only ever slows a run down, so the best
of a few is the least disturbed); beside them, the median over the rounds of each round's own ratios
(``paired_ratios_median``: a server figure over the engine figure measured just before it). The
8-request figure is measured twice: with ``--prompt-len`` prompts, whose prefills the server runs between
decode steps (the engine's figure leaves prefill out), and with ``--short-prompt`` prompts and
``--short-new-tokens`` tokens, where decoding is nearly all the work. With long prompts the engine's
decode-only figure is out of reach: the server must also prefill every prompt, so the script also prints
the bound that its engine sets (every prompt prefilled at the engine's own batch-8 prefill rate, every
token decoded at its batch-8 rate: ``c8_prefill_and_decode_bound_tokens_per_s``) and the server's share of
it. ``--max-prefill-tokens N`` is given to the server (default: the server's own, 256 tokens of prefill
between two decode steps: one 256-token prompt at a time, whole; ``0`` prefills whole prompts, all that
wait together).

    .venv/bin/python benchmarks/serve_vs_engine.py --json

The same figures by hand:

    dsv3 bench decode --model DIR --context 256 --new-tokens 64 --batch 1 --threads 1
    dsv3 serve --model DIR --threads 1 --quiet &
    dsv3 bench serve --url http://127.0.0.1:8000 --concurrency 1 --requests 4 --prompt-len 256 --new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.infer.bench_serve import make_prompts, model_card, run
from dsv3.model import Transformer
from serve_prefix_cache import server_command, start_server, write_word_tokenizer

C8_REQUESTS = 16  # the long-prompt requests sent at concurrency 8


def save_checkpoint(folder: Path, layers: int) -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("small"), num_hidden_layers=layers, num_nextn_predict_layers=0,
                              torch_dtype="bfloat16")
    Transformer(cfg).to(torch.bfloat16).save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)


def engine(folder: Path, batch: int, context: int, new_tokens: int, threads: int) -> dict:
    """`dsv3 bench decode --json` in its own process."""
    out = subprocess.run([sys.executable, "-m", "dsv3", "bench", "decode", "--model", str(folder), "--context",
                          str(context), "--new-tokens", str(new_tokens), "--batch", str(batch), "--threads",
                          str(threads), "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def unstreamed_ms_per_token(url: str, model: str, prompt: list[int], new_tokens: int) -> float:
    """One non-streamed request alone: (time for ``new_tokens`` - time for 1) / (new_tokens - 1), best of 2."""
    def seconds(n: int) -> float:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
        return time.perf_counter() - t0

    return 1000 * (min(seconds(new_tokens) for _ in range(2)) - min(seconds(1) for _ in range(2))) / (new_tokens - 1)


def one_round(folder: Path, url: str, card: dict, args, seed: int) -> dict:
    vocab, model, t = card["vocab_size"], card["id"], args.threads
    prompts = lambda n, length: make_prompts(n, length, 0, vocab, seed)  # noqa: E731
    row = {"engine_b1": engine(folder, 1, args.prompt_len, args.new_tokens, t)}
    row["serve_c1"] = run(url, model, prompts(4, args.prompt_len), args.new_tokens, 1, 600)
    row["serve_c1_unstreamed_ms_per_token"] = unstreamed_ms_per_token(url, model, prompts(1, args.prompt_len)[0],
                                                                      args.new_tokens)
    row["engine_b8"] = engine(folder, 8, args.prompt_len, args.new_tokens, t)
    row["serve_c8"] = run(url, model, prompts(C8_REQUESTS, args.prompt_len), args.new_tokens, 8, 600)
    row["engine_b8_short"] = engine(folder, 8, args.short_prompt, args.short_new_tokens, t)
    row["serve_c8_short"] = run(url, model, prompts(32, args.short_prompt), args.short_new_tokens, 8, 600)
    return row


def best(rows: list[dict]) -> dict:
    """Each figure's best round: the least time per token, the most tokens/s."""
    least = lambda get: min(get(row) for row in rows)  # noqa: E731
    most = lambda get: max(get(row) for row in rows)  # noqa: E731
    return {"engine_b1_ms_per_step": least(lambda r: r["engine_b1"]["ms_per_step"]),
            "serve_c1_tpot_p50_ms": least(lambda r: r["serve_c1"]["tpot_ms"]["p50"]),
            "serve_c1_unstreamed_ms_per_token": least(lambda r: r["serve_c1_unstreamed_ms_per_token"]),
            "engine_b8_tokens_per_s": most(lambda r: r["engine_b8"]["tokens_per_s"]),
            "engine_b8_prefill_s": least(lambda r: r["engine_b8"]["prefill_s"]),
            "serve_c8_tokens_per_s": most(lambda r: r["serve_c8"]["output_tokens_per_s"]),
            "serve_c8_tpot_p50_ms": least(lambda r: r["serve_c8"]["tpot_ms"]["p50"]),
            "engine_b8_short_tokens_per_s": most(lambda r: r["engine_b8_short"]["tokens_per_s"]),
            "serve_c8_short_tokens_per_s": most(lambda r: r["serve_c8_short"]["output_tokens_per_s"])}


def paired(rows: list[dict]) -> dict:
    """Each round's own ratios (its server figure over the engine figure measured just before it), their
    median over the rounds: on a host whose speed drifts, a pair measured together shares the drift, where
    the best of each side may come from different moments (and the engine's shorter runs spread wider)."""
    def median(get) -> float:
        values = sorted(get(row) for row in rows)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    return {"c1_tpot_over_step": median(lambda r: r["serve_c1"]["tpot_ms"]["p50"] / r["engine_b1"]["ms_per_step"]),
            "c8_tokens_per_s_over_engine": median(lambda r: r["serve_c8"]["output_tokens_per_s"]
                                                  / r["engine_b8"]["tokens_per_s"]),
            "c8_short_tokens_per_s_over_engine": median(lambda r: r["serve_c8_short"]["output_tokens_per_s"]
                                                        / r["engine_b8_short"]["tokens_per_s"])}


def prefill_and_decode_bound(b: dict, requests: int, new_tokens: int) -> float:
    """The most output tokens/s a server of this engine can deliver for ``requests`` long-prompt requests at
    concurrency 8: their prompts prefilled 8 at a time at the engine's batch-8 prefill time, and their
    tokens decoded at its batch-8 rate, one after the other (a CPU's cores do one or the other)."""
    tokens = requests * new_tokens
    return tokens / (requests / 8 * b["engine_b8_prefill_s"] + tokens / b["engine_b8_tokens_per_s"])


def ratios(b: dict) -> dict:
    step = b["engine_b1_ms_per_step"]
    return {"c1_tpot_over_step": b["serve_c1_tpot_p50_ms"] / step,
            "c1_unstreamed_over_step": b["serve_c1_unstreamed_ms_per_token"] / step,
            "c8_tokens_per_s_over_engine": b["serve_c8_tokens_per_s"] / b["engine_b8_tokens_per_s"],
            "c8_prefill_and_decode_bound_over_engine": b["c8_prefill_and_decode_bound_tokens_per_s"]
            / b["engine_b8_tokens_per_s"],
            "c8_tokens_per_s_over_bound": b["serve_c8_tokens_per_s"] / b["c8_prefill_and_decode_bound_tokens_per_s"],
            "c8_short_tokens_per_s_over_engine": b["serve_c8_short_tokens_per_s"] / b["engine_b8_short_tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the small shape (default: 4)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--short-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine and the server")
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="the server's prefill budget per decode step (default: its own; 0: whole prompts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "small-bf16"
        save_checkpoint(folder, args.layers)
        flags = () if args.max_prefill_tokens is None else ("--max-prefill-tokens", str(args.max_prefill_tokens))
        proc, url = start_server(server_command(folder, args.threads, flags=flags), args.threads,
                                 Path(tmp) / "serve.log")
        try:
            card = model_card(url)
            run(url, card["id"], make_prompts(1, 8, 0, card["vocab_size"], 99), 4, 1, 600)  # warm-up
            rows = [one_round(folder, url, card, args, seed) for seed in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    figures = best(rows)
    figures["c8_prefill_and_decode_bound_tokens_per_s"] = prefill_and_decode_bound(figures, C8_REQUESTS,
                                                                                   args.new_tokens)
    result = {"shape": f"small, {args.layers} layers, no MTP, bf16", "threads": args.threads,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "short_prompt": args.short_prompt,
              "short_new_tokens": args.short_new_tokens, "max_prefill_tokens": args.max_prefill_tokens,
              "rounds": args.rounds, "best": figures,
              "ratios": ratios(figures), "paired_ratios_median": paired(rows), "load_average": os.getloadavg()[0],
              "runs": rows}
    if args.json:
        print(json.dumps(result))
        return
    for name, value in {**figures, **result["ratios"]}.items():
        print(f"{name:40s} {value:10.2f}")
    for name, value in result["paired_ratios_median"].items():
        print(f"{'paired ' + name:40s} {value:10.2f}")


if __name__ == "__main__":
    main()
