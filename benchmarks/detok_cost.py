"""What detokenizing a stream costs per token, by the tokens generated: one decode of n ids (what the n-th
token cost when a stream decoded its whole sequence each time), against ``TextStream.push`` (a window of the
newest ids, ``dsv3.infer.detok``) averaged over a whole generation of n tokens. Both run on the server's
decode thread, once per row per step.

Two tokenizers of ``--vocab`` ids: a byte-level BPE with random merges (``serve_vs_vllm.py``'s; like
DeepSeek-V3's, its pieces split characters across tokens) and one word per token. The ids are drawn at
random, as a random model's are. Each figure is the best of ``--repeats`` runs.

    .venv/bin/python benchmarks/detok_cost.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from dsv3.infer.detok import TextStream
from dsv3.option_lists import parse_list
from serve_vs_vllm import byte_level_tokenizer


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return words


def best_us(work, repeats: int, per: int) -> float:
    """The fastest of ``repeats`` runs of ``work``, in microseconds per ``per``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return 1e6 * min(times) / per


def row(tokenizer, length: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(length)]

    def stream():
        s = TextStream(tokenizer)
        for token in ids:
            s.push(token)
        s.flush()

    return {"tokens": length,
            "whole_decode_us": best_us(lambda: tokenizer.decode(ids, skip_special_tokens=True), repeats, 1),
            "text_stream_push_us": best_us(stream, repeats, length)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,128,1024,4096", help="tokens generated (default: 16,128,1024,4096)")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lengths = parse_list(args.lengths, "--lengths", int)
    tokenizers = {"byte-level BPE": byte_level_tokenizer(args.vocab), "word per token": word_tokenizer(args.vocab)}
    rows = [{"tokenizer": name, **row(tok, n, args.repeats, seed=n)} for name, tok in tokenizers.items()
            for n in lengths]
    if args.json:
        print(json.dumps({"vocab": args.vocab, "repeats": args.repeats, "rows": rows}))
        return
    print(f"{'tokenizer':16s} {'tokens':>7s} {'whole decode us':>16s} {'TextStream us/token':>20s}")
    for r in rows:
        print(f"{r['tokenizer']:16s} {r['tokens']:7d} {r['whole_decode_us']:16.1f} {r['text_stream_push_us']:20.1f}")


if __name__ == "__main__":
    main()
