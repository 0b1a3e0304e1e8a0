"""The cost of structured output per decode step: a batch of 8 with one JSON-schema request against a
batch of 8 with none, on the same random model and prompts.

    .venv/bin/python benchmarks/structured_step.py --json > /tmp/structured_step.json
    .venv/bin/python benchmarks/structured_step.py --preset nano --rounds 3 --steps 8   # a quick look

The tokenizer is a byte-level BPE trained here on the repository's own text (docs and sources) to the
preset's vocabulary, with DeepSeek-V3's special tokens, so that the grammar's token masks cover a full
vocabulary. Each round prefills both batches afresh (untimed), takes ``--warm-up`` steps, then times
``--steps`` decode steps of each, alternating which goes first so that machine load hits both alike (a
constrained row that finishes early ends that round's timing; the steps timed are counted). Figures: the
median over rounds of the mean time per step; and the constrained request's own processing per step (its
mask: the matcher following the tokens, llguidance's mask and its application to the logits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.infer.grammar import Grammars
from dsv3.infer.sampling import SamplingParams
from dsv3.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
SCHEMA = {"type": "object", "required": ["name", "tags", "owner"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "owner": {"type": "object", "properties": {"age": {"type": "integer"}}}}}
BATCH = 8


def repository_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = [p for d in ("docs", "src") for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".md", ".py")]
    texts = [p.read_text() for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


class Timed:
    """A logits processor wrapped to add up the seconds it takes."""

    def __init__(self, processor):
        self.processor, self.seconds, self.calls = processor, 0.0, 0

    def __call__(self, tokens, logits):
        t0 = time.perf_counter()
        out = self.processor(tokens, logits)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def run_round(engine: Engine, prompts: list[list[int]], processor: Timed | None, warm_up: int,
              steps: int) -> tuple[float, int]:
    """(mean seconds per timed step, steps timed) for one batch of ``BATCH``."""
    hot = SamplingParams(temperature=1.0, seed=0)
    requests = [Request(p, warm_up + steps + 4, hot, ignore_eos=True) for p in prompts]
    if processor is not None:
        requests[0] = Request(prompts[0], warm_up + steps + 4, hot, logits_processors=(processor,))
    batch = engine.start(requests)
    for _ in range(warm_up):
        batch.step()
    if processor is not None:
        processor.seconds, processor.calls = 0.0, 0
    done, t0 = 0, time.perf_counter()
    while done < steps and len(batch.rows) == BATCH:
        batch.step()
        done += 1
    return (time.perf_counter() - t0) / max(done, 1), done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm-up", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    tok = repository_tokenizer(cfg.vocab_size)
    torch.manual_seed(0)
    model = Transformer(cfg).to(torch.bfloat16).eval()
    eos = frozenset({tok.token_to_id("<｜end▁of▁sentence｜>")})
    engine = Engine(model, tok, eos_token_ids=eos)
    grammars = Grammars(tok, cfg.vocab_size, eos)
    prompts = [tok.encode(f"Describe pet number {i} as JSON:").ids for i in range(BATCH)]
    plain, constrained, own, timed = [], [], [], 0
    for r in range(args.rounds):
        processor = Timed(grammars.json_schema(SCHEMA, "bench"))
        order = (None, processor) if r % 2 == 0 else (processor, None)
        for p in order:
            seconds, steps = run_round(engine, prompts, p, args.warm_up, args.steps)
            if p is None:
                plain.append(seconds)
            elif steps:
                constrained.append(seconds)
                own.append(processor.seconds / max(processor.calls, 1))
                timed += steps
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    result = {"preset": args.preset, "vocab": cfg.vocab_size, "dtype": "bf16", "threads": args.threads,
              "batch": BATCH, "rounds": args.rounds, "constrained_steps_timed": timed,
              "step_ms_none_constrained": ms(plain), "step_ms_one_constrained": ms(constrained),
              "processor_ms_per_call": ms(own)}
    result["extra_ms_per_step"] = round(result["step_ms_one_constrained"] - result["step_ms_none_constrained"], 3)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
