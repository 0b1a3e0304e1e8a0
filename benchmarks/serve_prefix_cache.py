"""Time to first token with and without a shared prompt prefix, measured with `dsv3 bench serve`'s client
against a real `dsv3 serve` process (prefix cache on, its default).

A random-weight preset checkpoint is saved to a temporary folder (speed does not depend on the weights)
and served; then rounds alternate between prompts with nothing in common and prompts sharing their
first ``--shared-prefix`` tokens (a fresh prefix each round, so its first request is a miss), so that a
busy machine slows both alike. Requests go one at a time (``--concurrency``), so that TTFT is prefill
plus one step, not queueing.

    .venv/bin/python benchmarks/serve_prefix_cache.py --json
    .venv/bin/python benchmarks/serve_prefix_cache.py --ep 4 --json                     # 4 processes (torchrun)
    .venv/bin/python benchmarks/serve_prefix_cache.py --ep 4 --prefill-ranks 2 --json   # ranks 0-1 prefill

The same figures by hand, against a running server:

    dsv3 bench serve --url http://127.0.0.1:8000 --requests 8 --prompt-len 1016 --new-tokens 16 --shared-prefix 1000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer whose every token is a word ("t17"), so that the server streams a chunk for every token
    it generates, as it does for the tokens of real text (without a tokenizer it has no text to send)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsv3.infer.loading import TOKENIZER_FILE

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(folder / TOKENIZER_FILE))


def server_command(folder: Path, threads: int, ep: int = 0, prefill_ranks: int = 0,
                   flags: tuple[str, ...] = ()) -> list[str]:
    """`dsv3 serve` (with more ``flags``) in one process, or ``ep`` under torchrun (``--ep``, with
    ``--prefill-ranks`` when given)."""
    serve = ["-m", "dsv3", "serve", "--model", str(folder), "--port", "0", "--threads", str(threads), "--quiet",
             *flags]
    if not ep:
        return [sys.executable, *serve]
    group = ["--ep", str(ep)] + (["--prefill-ranks", str(prefill_ranks)] if prefill_ranks else [])
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ep), *serve,
            *group]


def start_server(command: list[str], threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    err = open(log, "w")  # noqa: SIM115 - the child writes to it for its whole life
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {log.read_text()}")
        time.sleep(0.2)
    stop_server(proc)
    raise SystemExit("serve did not start in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session (torchrun's ranks too), then SIGKILL when it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="random-weight model to serve (default: small)")
    ap.add_argument("--prompt-len", type=int, default=1016)
    ap.add_argument("--shared-prefix", type=int, default=1000)
    ap.add_argument("--new-tokens", dest="gen_len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=6, help="per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (per process)")
    ap.add_argument("--ep", type=int, default=0, help="serve over this many processes (serve --ep N)")
    ap.add_argument("--prefill-ranks", type=int, default=0, help="with --ep: the first P ranks prefill")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Transformer(preset(args.preset)).save_pretrained(Path(tmp) / args.preset)
        command = server_command(Path(tmp) / args.preset, args.threads, args.ep, args.prefill_ranks)
        proc, url = start_server(command, args.threads, Path(tmp) / "serve.log")
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
            stop_server(proc)

    def median(key: str, sub: str, shared: int) -> float:
        values = [row[key][sub] for row in rows if row["shared_prefix"] == shared and row[key][sub] is not None]
        return statistics.median(values)

    cold = median("ttft_ms", "p50", 0)
    warm = median("ttft_ms_cached", "p50", args.shared_prefix)
    result = {"preset": args.preset, "prompt_len": args.prompt_len, "shared_prefix": args.shared_prefix,
              "gen_len": args.gen_len, "requests_per_round": args.requests, "rounds": args.rounds,
              "concurrency": args.concurrency, "server_threads": args.threads, "ep": args.ep,
              "prefill_ranks": args.prefill_ranks,
              "ttft_p50_ms_no_shared_prefix": cold, "ttft_p50_ms_prefix_cached": warm,
              "ttft_p50_ms_first_of_prefix": median("ttft_ms_uncached", "p50", args.shared_prefix),
              "ttft_ratio_cached_over_uncached": warm / cold,
              "tpot_p50_ms_no_shared_prefix": median("tpot_ms", "p50", 0),
              "tpot_p50_ms_shared_prefix": median("tpot_ms", "p50", args.shared_prefix),
              "cached_token_share": [row["cached_token_share"] for row in rows],
              "cached_tokens_min_of_cached_requests": min(
                  (n for row in rows if row["shared_prefix"] for n in row["cached_tokens_per_request"] if n),
                  default=0), "runs": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.preset}, prompts of {args.prompt_len} tokens, {args.gen_len} generated, "
          f"{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}")
    print(f"  TTFT p50, nothing shared:             {cold:8.1f} ms")
    print(f"  TTFT p50, {args.shared_prefix}-token prefix cached:  {warm:8.1f} ms  ({warm / cold:.1%})")
    print(f"  TTFT, first request of each prefix:   {result['ttft_p50_ms_first_of_prefix']:8.1f} ms")
    print(f"  cached tokens, least of the cached requests: {result['cached_tokens_min_of_cached_requests']}")


if __name__ == "__main__":
    main()
