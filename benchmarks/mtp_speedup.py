"""MTP speculative decoding on a model trained with MTP: acceptance rate, tokens per main-model forward,
and decode tokens/s with and without speculation (CPU, batch 1, runs alternating).

Prompts are chunks of the running Python's standard library (what `dsv3 train` learns from by default),
so no download is needed; pass --prompt-file to use your own text instead.

    .venv/bin/python -m dsv3 train --preset nano --steps 300 --out runs/nano
    .venv/bin/python benchmarks/mtp_speedup.py --model runs/nano/latest --json

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

from dsv3.infer.engine import Engine, Request
from dsv3.infer.loading import load_model, load_tokenizer
from dsv3.infer.sampling import SamplingParams


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7", help="0 = greedy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model, required=True)
    model = load_model(args.model)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
        prompts = [tokenizer.encode(line).ids for line in text.splitlines() if line.strip()][: args.prompts]
    else:
        prompts = stdlib_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    plain = Engine(model, tokenizer, speculative=False, eos_token_ids=frozenset())
    spec = Engine(model, tokenizer, speculative=True, eos_token_ids=frozenset())
    rows = []
    for temp in (float(t) for t in args.temperatures.split(",")):
        agg = {"plain": [], "mtp": []}
        same = True
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=temp, seed=args.seed + i)
            a, b = run(plain, prompt, args.new_tokens, params), run(spec, prompt, args.new_tokens, params)
            same &= temp > 0 or a["tokens"] == b["tokens"]
            agg["plain"].append(a)
            agg["mtp"].append(b)
            print(f"T={temp} prompt {i}: plain {a['decode_tokens'] / a['decode_s']:.1f} tok/s, "
                  f"mtp {b['decode_tokens'] / b['decode_s']:.1f} tok/s, accepted {b['accepted']}/{b['drafted']}",
                  file=sys.stderr, flush=True)
        tps = {k: sum(r["decode_tokens"] for r in v) / sum(r["decode_s"] for r in v) for k, v in agg.items()}
        drafted = sum(r["drafted"] for r in agg["mtp"])
        accepted = sum(r["accepted"] for r in agg["mtp"])
        rows.append({
            "temperature": temp, "prompts": len(prompts), "new_tokens": args.new_tokens,
            "acceptance_rate": accepted / drafted,
            "acceptance_rate_median_prompt": statistics.median(r["accepted"] / r["drafted"] for r in agg["mtp"]),
            "tokens_per_forward": sum(r["decode_tokens"] for r in agg["mtp"]) / sum(r["forwards"] for r in agg["mtp"]),
            "plain_tokens_per_s": tps["plain"], "mtp_tokens_per_s": tps["mtp"],
            "speedup": tps["mtp"] / tps["plain"], "greedy_outputs_identical": same if temp == 0 else None,
        })
    result = {"benchmark": "mtp_speedup", "model": args.model, "threads": args.threads, "rows": rows,
              "paper": {"acceptance_rate": [0.80, 0.90], "tps_speedup": 1.8}}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(f"T={r['temperature']}: acceptance {r['acceptance_rate']:.1%}, {r['tokens_per_forward']:.2f} "
                  f"tokens/forward, {r['plain_tokens_per_s']:.1f} -> {r['mtp_tokens_per_s']:.1f} tokens/s "
                  f"({r['speedup']:.2f}x)")


if __name__ == "__main__":
    main()
