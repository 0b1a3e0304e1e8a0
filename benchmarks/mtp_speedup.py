"""MTP speculative decoding on a model trained with MTP: acceptance rate, tokens per main-model forward,
and decode tokens/s with and without speculation (CPU, batch 1, runs alternating).

Prompts are chunks of the running Python's standard library (what `dsv3 train` learns from by default),
so no download is needed; pass --prompt-file to use your own text instead.

    .venv/bin/python -m dsv3 train --preset nano --steps 300 --out runs/nano
    .venv/bin/python benchmarks/mtp_speedup.py --model runs/nano/latest --json

``--draft-vocab 512,1024`` also runs speculation with the MTP draft restricted to the K most frequent
tokens (``dsv3 draft-vocab --model DIR`` writes their ranking first), each K beside the full draft head
in the same alternation (rows ``draft_vocab``: null for the full head).

The paper (ISCA §2.3.3, V3 §5.4.3): 80-90% (V3: 85-90%) acceptance of the second token, 1.8x TPS.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
from pathlib import Path

import torch

from dsv3.errors import DSV3Error
from dsv3.infer.draft_vocab import load as load_draft_vocab
from dsv3.infer.engine import Engine, Request
from dsv3.infer.loading import load_model, load_tokenizer
from dsv3.infer.sampling import SamplingParams
from dsv3.option_lists import parse_list
from dsv3.run_dir import resolve_checkpoint


def stdlib_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens cut from random standard-library modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        ids = tokenizer.encode(rng.choice(files).read_text(errors="replace")).ids
        if len(ids) > length + 1:
            start = rng.randrange(0, len(ids) - length)
            prompts.append(ids[start : start + length])
    return prompts


def run(engine: Engine, prompt: list[int], n: int, params: SamplingParams) -> dict:
    result = engine.generate([Request(prompt, n, params)])[0]
    s = engine.last_stats
    return {"tokens": result.token_ids, "decode_s": s.decode_s, "decode_tokens": s.tokens,
            "drafted": s.drafted, "accepted": s.accepted, "forwards": s.main_forwards}


def tokens_per_s(runs: list[dict]) -> float:
    return sum(r["decode_tokens"] for r in runs) / sum(r["decode_s"] for r in runs)


def summary(runs: list[dict], plain_tps: float, temp: float, prompts: int, new_tokens: int, k: int | None,
            same: bool) -> dict:
    """One row: a speculative variant's acceptance and speed against the plain runs of the same prompts."""
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    tps = tokens_per_s(runs)
    return {
        "temperature": temp, "draft_vocab": k, "prompts": prompts, "new_tokens": new_tokens,
        "acceptance_rate": accepted / drafted,
        "acceptance_rate_median_prompt": statistics.median(r["accepted"] / r["drafted"] for r in runs),
        "tokens_per_forward": sum(r["decode_tokens"] for r in runs) / sum(r["forwards"] for r in runs),
        "plain_tokens_per_s": plain_tps, "mtp_tokens_per_s": tps, "speedup": tps / plain_tps,
        "greedy_outputs_identical": same if temp == 0 else None,
    }


def main() -> None:
    try:
        measure()
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def measure() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7", help="0 = greedy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", default="", help="comma-separated K: also draft over the K most frequent tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint(args.model)
    tokenizer = load_tokenizer(folder, needed_for="--prompt")
    model = load_model(folder)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
        prompts = [tokenizer.encode(line).ids for line in text.splitlines() if line.strip()][: args.prompts]
    else:
        prompts = stdlib_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    plain = Engine(model, tokenizer, speculative=False, eos_token_ids=frozenset())
    ks = parse_list(args.draft_vocab, "--draft-vocab", int) if args.draft_vocab.strip() else []
    spec = {None: Engine(model, tokenizer, speculative=True, eos_token_ids=frozenset())}
    for k in ks:
        vocab = load_draft_vocab(folder, k, model.config.vocab_size)
        spec[k] = Engine(model, tokenizer, speculative=True, eos_token_ids=frozenset(), draft_vocab=vocab)
    rows = []
    for temp in parse_list(args.temperatures, "--temperatures", float):
        agg = {"plain": [], **{k: [] for k in spec}}
        same = dict.fromkeys(spec, True)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=temp, seed=args.seed + i)
            a = run(plain, prompt, args.new_tokens, params)
            agg["plain"].append(a)
            line = f"T={temp} prompt {i}: plain {a['decode_tokens'] / a['decode_s']:.1f} tok/s"
            for k, engine in spec.items():
                b = run(engine, prompt, args.new_tokens, params)
                same[k] &= temp > 0 or a["tokens"] == b["tokens"]
                agg[k].append(b)
                line += (f", mtp{'' if k is None else f' K={k}'} {b['decode_tokens'] / b['decode_s']:.1f} tok/s "
                         f"accepted {b['accepted']}/{b['drafted']}")
            print(line, file=sys.stderr, flush=True)
        plain_tps = tokens_per_s(agg["plain"])
        for k in spec:
            rows.append(summary(agg[k], plain_tps, temp, len(prompts), args.new_tokens, k, same[k]))
    result = {"benchmark": "mtp_speedup", "model": args.model, "threads": args.threads, "rows": rows,
              "paper": {"acceptance_rate": [0.80, 0.90], "tps_speedup": 1.8}}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(f"T={r['temperature']} draft vocab {r['draft_vocab'] or 'full'}: "
                  f"acceptance {r['acceptance_rate']:.1%}, {r['tokens_per_forward']:.2f} "
                  f"tokens/forward, {r['plain_tokens_per_s']:.1f} -> {r['mtp_tokens_per_s']:.1f} tokens/s "
                  f"({r['speedup']:.2f}x)")


if __name__ == "__main__":
    main()
