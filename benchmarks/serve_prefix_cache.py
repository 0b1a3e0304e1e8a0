"""Time to first token with and without a shared prompt prefix, measured with `dsv3 bench serve`'s client
against a real `dsv3 serve` process (prefix cache on, its default).

A random-weight preset checkpoint is saved to a temporary folder (speed does not depend on the weights)
and served; then rounds alternate between prompts with nothing in common and prompts sharing their
first ``--shared-prefix`` tokens (a fresh prefix each round, so its first request is a miss), so that a
busy machine slows both alike. Requests go one at a time (``--concurrency``), so that TTFT is prefill
plus one step, not queueing.

    .venv/bin/python benchmarks/serve_prefix_cache.py --json

The same figures by hand, against a running server:

    dsv3 bench serve --url http://127.0.0.1:8000 --requests 8 --prompt-len 1016 --new-tokens 16 --shared-prefix 1000
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.infer.bench_serve import make_prompts, model_card, run
from dsv3.model import Transformer


def start_server(folder: Path, threads: int, log: Path, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`dsv3 serve` on a free port (with more ``flags``); returns the process and its base URL."""
    err = open(log, "w")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen([sys.executable, "-m", "dsv3", "serve", "--model", str(folder), "--port", "0",
                             "--threads", str(threads), "--quiet", *flags], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 300
    while time.time() < deadline:
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("serve did not start in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="random-weight model to serve (default: small)")
    ap.add_argument("--prompt-len", type=int, default=1016)
    ap.add_argument("--shared-prefix", type=int, default=1000)
    ap.add_argument("--new-tokens", dest="gen_len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=6, help="per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Transformer(preset(args.preset)).save_pretrained(Path(tmp) / args.preset)
        proc, url = start_server(Path(tmp) / args.preset, args.threads, Path(tmp) / "serve.log")
        try:
            card = model_card(url)
            rows = []
            for r in range(args.rounds):
                for shared in (0, args.shared_prefix):
                    seed = 2 * r + (shared > 0)  # no round shares a token sequence with another
                    prompts = make_prompts(args.requests, args.prompt_len, shared, card["vocab_size"], seed)
                    out = run(url, card["id"], prompts, args.gen_len, args.concurrency, timeout=600)
                    rows.append({"round": r, "shared_prefix": shared, **out})
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    def median(key: str, sub: str, shared: int) -> float:
        values = [row[key][sub] for row in rows if row["shared_prefix"] == shared and row[key][sub] is not None]
        return statistics.median(values)

    cold = median("ttft_ms", "p50", 0)
    warm = median("ttft_ms_cached", "p50", args.shared_prefix)
    result = {"preset": args.preset, "prompt_len": args.prompt_len, "shared_prefix": args.shared_prefix,
              "gen_len": args.gen_len, "requests_per_round": args.requests, "rounds": args.rounds,
              "concurrency": args.concurrency, "server_threads": args.threads,
              "ttft_p50_ms_no_shared_prefix": cold, "ttft_p50_ms_prefix_cached": warm,
              "ttft_p50_ms_first_of_prefix": median("ttft_ms_uncached", "p50", args.shared_prefix),
              "ttft_ratio_cached_over_uncached": warm / cold,
              "tpot_p50_ms_no_shared_prefix": median("tpot_ms", "p50", 0),
              "tpot_p50_ms_shared_prefix": median("tpot_ms", "p50", args.shared_prefix),
              "cached_token_share": [row["cached_token_share"] for row in rows], "runs": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.preset}, prompts of {args.prompt_len} tokens, {args.gen_len} generated, "
          f"{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}")
    print(f"  TTFT p50, nothing shared:             {cold:8.1f} ms")
    print(f"  TTFT p50, {args.shared_prefix}-token prefix cached:  {warm:8.1f} ms  ({warm / cold:.1%})")
    print(f"  TTFT, first request of each prefix:   {result['ttft_p50_ms_first_of_prefix']:8.1f} ms")


if __name__ == "__main__":
    main()
