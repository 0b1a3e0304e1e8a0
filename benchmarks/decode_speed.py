"""Decode speed at batch 1, dsv3's engine vs transformers' DeepseekV3ForCausalLM on the same weights (CPU).

Both load one checkpoint (a V3-architecture model of the ``small`` preset shape, random weights, fp32),
both prefill the same random context and then decode greedily; only the decode steps are timed. Runs
alternate between the two implementations at every context so that machine load hits both alike.

    .venv/bin/python benchmarks/decode_speed.py --contexts 256,512,2048,4096 --new-tokens 32 --json

Prints one JSON object: per context and implementation, ms per token and tokens/s (median of repeats),
the speed-up, the latent-cache bytes per token per layer measured from each allocation, and the ratio of
time per token at the longest context to the shortest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from dsv3 import load_pretrained
from dsv3.config import preset
from dsv3.infer.bench import cache_precision
from dsv3.infer.engine import Engine, Request
from dsv3.model import Transformer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_checkpoint(folder: str, preset_name: str, max_len: int) -> None:
    cfg = preset(preset_name).replace(max_position_embeddings=max_len)
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(folder)


def ours_decode(engine: Engine, prompt: list[int], n: int) -> tuple[float, float]:
    """(seconds per decode token, cache bytes per token per layer from the allocation)."""
    for _ in engine.stream([Request(prompt, n + 1)]):
        pass
    stats = engine.last_stats
    return stats.decode_s / stats.tokens, stats.cache_bytes_per_token_per_layer


@torch.inference_mode()
def hf_decode(hf, prompt: list[int], n: int) -> tuple[float, float]:
    """Greedy decode with transformers' own cache; same timing boundaries as ours."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(n):
        out = hf(token, cache=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    elapsed = time.perf_counter() - t0
    return elapsed / n, _hf_cache_bytes_per_token_per_layer(cache, len(prompt) + n)


def _hf_cache_bytes_per_token_per_layer(cache, tokens: int) -> float:
    layers = cache.layers
    total = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)
    return total / (len(layers) * tokens)


def weight_precision(folder: str, prompt: list[int], new_tokens: int) -> dict:
    """Resident weight bytes and decode speed for fp32, bf16 and FP8-block weights (dequantized per layer)."""
    from dsv3.infer.fp8_weights import resident_bytes
    from dsv3.infer.loading import load_model

    out = {}
    for name, dtype, weights in (("fp32", torch.float32, "native"), ("bf16", torch.bfloat16, "native"),
                                 ("fp8_blocks_bf16_compute", torch.bfloat16, "fp8")):
        model = load_model(folder, dtype, weights)
        per_token, _ = ours_decode(Engine(model, eos_token_ids=frozenset()), prompt, new_tokens)
        out[name] = {"resident_weight_bytes": resident_bytes(model), "ms_per_token": 1000 * per_token}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--contexts", default="256,512,2048,4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the shared CI machine: 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder, args.preset, max(contexts) + args.new_tokens + 8)
        ours = Engine(load_pretrained(folder, dtype=torch.float32), eos_token_ids=frozenset())
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        vocab = ours.model.config.vocab_size
        log("weights: fp32 / bf16 / fp8 blocks")
        weights = weight_precision(folder, list(range(1, 257)), args.new_tokens)
    log("cache precision: fp32 / bf16 / fp8")
    caches = cache_precision(ours.model)
    ours_decode(ours, list(range(16)), 4)  # warm-up: first calls pay for lazy initialisation
    hf_decode(hf, list(range(16)), 4)
    rows = []
    for ctx in contexts:
        prompt = torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
        times: dict[str, list[float]] = {"dsv3": [], "transformers": []}
        cache_bpt = {}
        for rep in range(args.repeats):
            for name, decode, impl in (("dsv3", ours_decode, ours), ("transformers", hf_decode, hf)):
                per_token, cache_bpt[name] = decode(impl, prompt, args.new_tokens)
                times[name].append(per_token)
                log(f"context {ctx} repeat {rep} {name}: {1000 * per_token:.2f} ms/token")
        row = {"context": ctx}
        for name, ts in times.items():
            med = statistics.median(ts)
            row[name] = {"ms_per_token": 1000 * med, "tokens_per_s": 1 / med,
                         "cache_bytes_per_token_per_layer": cache_bpt[name]}
        row["speedup"] = row["transformers"]["ms_per_token"] / row["dsv3"]["ms_per_token"]
        rows.append(row)
    cfg = ours.model.config
    result = {
        "benchmark": "decode_speed", "preset": args.preset, "batch": 1, "dtype": "float32",
        "threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "expected_cache_bytes_per_token_per_layer": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4,
        "rows": rows, "cache_precision": caches, "weight_precision": weights,
        "dsv3_longest_over_shortest": rows[-1]["dsv3"]["ms_per_token"] / rows[0]["dsv3"]["ms_per_token"],
        "transformers_longest_over_shortest":
            rows[-1]["transformers"]["ms_per_token"] / rows[0]["transformers"]["ms_per_token"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'context':>8} {'dsv3 ms/tok':>12} {'hf ms/tok':>10} {'speedup':>8}")
        for r in rows:
            print(f"{r['context']:>8} {r['dsv3']['ms_per_token']:>12.2f} {r['transformers']['ms_per_token']:>10.2f} "
                  f"{r['speedup']:>8.2f}")


if __name__ == "__main__":
    main()
