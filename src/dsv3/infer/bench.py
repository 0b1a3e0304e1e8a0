"""`dsv3 bench decode`: decode-phase speed of the engine at a given context, on random token ids."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

from dsv3.errors import DSV3Error
from dsv3.infer.options import CACHE_DTYPE, DTYPE, SPECULATIVE, THREADS, WEIGHTS


def _model(source: str, dtype: str, weights: str):
    """A checkpoint or training run folder, or a preset name (random weights: speed does not depend on
    their values)."""
    from dsv3.config import PRESETS, preset
    from dsv3.infer.loading import load_model, parse_dtype, with_weights
    from dsv3.model.transformer import Transformer

    compute = parse_dtype(dtype, "--dtype", ("fp32", "bf16"))
    if Path(source).exists():
        return load_model(source, compute, weights)  # a checkpoint or training run folder
    if source not in PRESETS:
        raise DSV3Error(f"--model {source!r} is neither a checkpoint or run folder nor a preset "
                        f"({', '.join(PRESETS)})")
    torch.manual_seed(0)
    model = Transformer(preset(source)).to(compute or torch.float32).eval()
    return with_weights(model, weights)


@torch.inference_mode()
def cache_precision(model, context: int = 256, steps: int = 32, seed: int = 1) -> dict:
    """Teacher-forced decode over caches of each dtype: relative logit error against the fp32 cache and
    how often the argmax agrees."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context + steps), generator=torch.Generator().manual_seed(seed))
    logits = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        cache = model.new_cache(1, context + steps, dtype=dtype)
        model(ids[:, :context], cache=cache)
        logits[name] = torch.cat([model(ids[:, t : t + 1], cache=cache, start_pos=t)[0]
                                  for t in range(context, context + steps)])
    ref = logits["fp32"]
    return {name: {"relative_logit_error": float((x - ref).norm() / ref.norm()),
                   "argmax_agreement": float((x.argmax(-1) == ref.argmax(-1)).float().mean())}
            for name, x in logits.items() if name != "fp32"}


def main(
    model: str = typer.Option(..., "--model", metavar="PATH|PRESET",
                              help="Checkpoint folder, training run folder, or a preset name (random weights)."),
    context: int = typer.Option(2048, "--context", metavar="N", show_default=False,
                                help="Prompt tokens per row before decoding (default: 2048)."),
    new_tokens: int = typer.Option(64, "--new-tokens", metavar="N", show_default=False,
                                   help="Decode steps timed, at least 2 (default: 64)."),
    batch: int = typer.Option(1, "--batch", metavar="N", show_default=False,
                              help="Rows decoded together (default: 1)."),
    speculative: str = SPECULATIVE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    cache_dtype: str = CACHE_DTYPE,
    threads: int = THREADS,
    seed: int = typer.Option(0, "--seed", metavar="N", show_default=False,
                             help="Seed of the random prompts and weights (default: 0)."),
    cache_error: bool = typer.Option(False, "--cache-error", metavar="",
                                     help="Also measure the bf16/fp8 cache's logit error against fp32."),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object."),
) -> None:
    """Decode speed: prefill --context random tokens per row, then time --new-tokens decode steps alone."""
    from dsv3.infer.engine import Engine, Request
    from dsv3.infer.fp8_weights import resident_bytes
    from dsv3.infer.loading import parse_dtype
    from dsv3.infer.sampling import GREEDY

    if speculative not in ("mtp", "none"):
        raise DSV3Error(f"--speculative must be mtp or none, got {speculative!r}")
    for value, low, flag in ((context, 1, "--context"), (new_tokens, 2, "--new-tokens"), (batch, 1, "--batch"),
                             (threads, 0, "--threads"), (seed, 0, "--seed")):
        if value < low:
            raise DSV3Error(f"{flag} must be >= {low}, got {value}")
    if threads:
        torch.set_num_threads(threads)
    net = _model(model, dtype, weights)
    cfg = net.config
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, context), generator=gen).tolist()
    engine = Engine(net, speculative=speculative == "mtp",
                    cache_dtype=parse_dtype(cache_dtype, "--cache-dtype", ("fp32", "bf16", "fp8")),
                    eos_token_ids=frozenset())
    for _ in engine.stream([Request(p, new_tokens, GREEDY) for p in prompts]):
        pass
    stats = engine.last_stats
    out = {
        "model": model, "context": context, "new_tokens": new_tokens, "batch": batch, "speculative": speculative,
        "threads": torch.get_num_threads(), "dtype": str(next(net.parameters()).dtype).replace("torch.", ""),
        "weights": weights, "cache_dtype": str(engine.cache_dtype).replace("torch.", ""),
        "tokens_per_s": stats.tokens / stats.decode_s,
        "ms_per_step": 1000 * stats.decode_s / max(stats.main_forwards, 1),
        "prefill_s": stats.prefill_s, "cache_bytes": stats.cache_bytes,
        "cache_bytes_per_token_per_layer": stats.cache_bytes_per_token_per_layer,
        "weight_bytes": resident_bytes(net),
        "acceptance_rate": stats.acceptance_rate, "tokens_per_forward": stats.tokens_per_forward,
        "beyond_context": engine.context is not None and context + new_tokens > engine.context,
    }
    if cache_error:
        out["cache_precision"] = cache_precision(net, context=min(context, 512), seed=seed)
    print(json.dumps(out) if as_json else "\n".join(report_lines(out)))


def report_lines(r: dict) -> list[str]:
    """The human report of one run: short labelled lines with scaled units, none wider than 80 columns."""
    from dsv3.infer.units import fmt_bytes, fmt_duration

    step_s = r["ms_per_step"] / 1000
    lines = [
        f"decode benchmark of {r['model']}",
        f"  batch {r['batch']}, context {r['context']}, {r['new_tokens']} new tokens, speculative "
        f"{r['speculative']}, {r['threads']} threads",
        f"  {r['dtype']} compute, {r['weights']} weights, {r['cache_dtype']} cache",
        f"  decode   {r['tokens_per_s']:,.1f} tokens/s, {fmt_duration(step_s)} per step",
        f"  prefill  {fmt_duration(r['prefill_s'])}",
        f"  cache    {fmt_bytes(r['cache_bytes'])} ({fmt_bytes(r['cache_bytes_per_token_per_layer'])} per token "
        "per layer)",
        f"  weights  {fmt_bytes(r['weight_bytes'])} resident",
    ]
    if r["acceptance_rate"] is not None:
        lines.append(f"  MTP      {r['acceptance_rate']:.0%} of drafts accepted, {r['tokens_per_forward']:.2f} "
                     "tokens per forward")
    for name, err in (r.get("cache_precision") or {}).items():
        lines.append(f"  {name} cache vs fp32: logit error {err['relative_logit_error']:.2%}, argmax agrees "
                     f"{err['argmax_agreement']:.0%}")
    if r["beyond_context"]:
        lines.append("  note: context + new tokens exceed the model's max_position_embeddings (speed only)")
    return lines
