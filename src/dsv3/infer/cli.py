"""`dsv3 generate`, `dsv3 chat`, `dsv3 serve`: thin commands over the engine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from dsv3.errors import DSV3Error

generate_app = typer.Typer(add_completion=False, help="Generate text from a checkpoint (latent-cache decode, MTP).")
chat_app = typer.Typer(add_completion=False, help="Chat with a checkpoint in the terminal.")
serve_app = typer.Typer(add_completion=False, help="Serve a checkpoint over an OpenAI-compatible HTTP API.")

MODEL = typer.Option(..., "--model", help="Checkpoint folder (config.json + safetensors [+ tokenizer.json]).")
DTYPE = typer.Option("auto", "--dtype", help="Compute/weight dtype: auto (as stored), fp32, bf16.")
WEIGHTS = typer.Option("native", "--weights", help="native, or fp8: projections resident as FP8 blocks.")
CACHE_DTYPE = typer.Option("auto", "--cache-dtype", help="Latent cache dtype: auto (= compute), fp32, bf16, fp8.")
SPECULATIVE = typer.Option("none", "--speculative", help="mtp: draft with the MTP layer; none: plain decoding.")
THREADS = typer.Option(0, "--threads", min=0, help="torch intra-op threads (0: torch's default; 1 is often "
                       "fastest for small models on a busy machine).")


def build_engine(model_dir: str, dtype: str, weights: str, cache_dtype: str, speculative: str,
                 ignore_eos: bool = False, require_tokenizer: bool = False, threads: int = 0):
    """Model, tokenizer and engine from the shared command-line options."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from dsv3.infer.engine import Engine
    from dsv3.infer.loading import eos_ids, load_model, load_tokenizer, parse_dtype

    if speculative not in ("mtp", "none"):
        raise DSV3Error(f"--speculative must be mtp or none, got {speculative!r}")
    compute = parse_dtype(dtype, "--dtype", ("fp32", "bf16"))
    cache = parse_dtype(cache_dtype, "--cache-dtype", ("fp32", "bf16", "fp8"))
    if not Path(model_dir).is_dir():
        raise DSV3Error(f"checkpoint folder not found: {model_dir}")
    tokenizer = load_tokenizer(model_dir, required=require_tokenizer)
    model = load_model(model_dir, compute, weights)
    eos = frozenset() if ignore_eos else eos_ids(model, tokenizer)
    return Engine(model, tokenizer, speculative=speculative == "mtp", cache_dtype=cache, eos_token_ids=eos)


def sampling_from_flags(greedy: bool, temperature: float | None, top_p: float | None, top_k: int | None,
                        seed: int | None):
    from dsv3.infer.sampling import SamplingParams

    if greedy and any(v is not None for v in (temperature, top_p, top_k)):
        raise DSV3Error("--greedy cannot be combined with --temperature, --top-p or --top-k")
    if greedy:
        return SamplingParams(temperature=0.0, seed=seed)
    return SamplingParams(temperature=1.0 if temperature is None else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed)


def parse_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise DSV3Error(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DSV3Error(f"--prompt-ids has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if not ids:
        raise DSV3Error("--prompt-ids is empty")
    return ids


@generate_app.command()
def generate(
    model: str = MODEL,
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs tokenizer.json)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most likely token."),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, help="Default 1.0."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass, (0, 1]."),
    top_k: int | None = typer.Option(None, "--top-k", min=0),
    seed: int | None = typer.Option(None, "--seed"),
    speculative: str = SPECULATIVE,
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the end-of-sequence token."),
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    cache_dtype: str = CACHE_DTYPE,
    threads: int = THREADS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate a continuation of one prompt, streaming it (or one JSON object with --json)."""
    from dsv3.infer.engine import Request
    from dsv3.infer.fp8_weights import resident_bytes
    from dsv3.infer.loading import encode

    if (prompt is None) == (prompt_ids is None):
        raise DSV3Error("give exactly one of --prompt or --prompt-ids")
    params = sampling_from_flags(greedy, temperature, top_p, top_k, seed)
    engine = build_engine(model, dtype, weights, cache_dtype, speculative, ignore_eos,
                          require_tokenizer=prompt is not None or bool(stop), threads=threads)
    ids = parse_ids(prompt_ids, engine.model.config.vocab_size) if prompt_ids else encode(engine.tokenizer, prompt)
    request = Request(ids, max_new_tokens, params, stop_strings=tuple(stop))
    tokens, text, reason = [], [], "length"
    t0 = time.perf_counter()
    for ev in engine.stream([request]):
        tokens += ev.token_ids
        text.append(ev.text)
        reason = ev.finish_reason or reason
        if not as_json:
            _echo_stream(ev, engine.tokenizer)
    elapsed = time.perf_counter() - t0
    stats = engine.last_stats
    if as_json:
        out = {"text": "".join(text), "token_ids": tokens, "finish_reason": reason, "prompt_tokens": len(ids),
               "tokens_per_s": len(tokens) / elapsed, "prefill_s": stats.prefill_s,
               "decode_tokens_per_s": stats.tokens / stats.decode_s if stats.decode_s else None,
               "cache_bytes": stats.cache_bytes, "weight_bytes": resident_bytes(engine.model),
               "speculative": speculative}
        if engine.speculative:
            out["acceptance_rate"] = stats.acceptance_rate
            out["tokens_per_forward"] = stats.tokens_per_forward
        print(json.dumps(out))
        return
    sys.stdout.write("\n")
    _report(len(tokens), elapsed, stats, engine.speculative)


def _echo_stream(ev, tokenizer) -> None:
    if tokenizer is not None:
        sys.stdout.write(ev.text)
    elif ev.token_ids:
        sys.stdout.write(",".join(str(t) for t in ev.token_ids) + ",")
    sys.stdout.flush()


def _report(n_tokens: int, elapsed: float, stats, speculative: bool) -> None:
    from rich.console import Console

    line = f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s), cache {stats.cache_bytes} B"
    if speculative and stats.acceptance_rate is not None:
        line += f", MTP acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_forward:.2f} tokens/forward"
    Console(stderr=True).print(f"[dim]{line}[/dim]")


@chat_app.command()
def chat(
    model: str = MODEL,
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.7, "--temperature", min=0.0),
    top_p: float = typer.Option(0.95, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    speculative: str = SPECULATIVE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    threads: int = THREADS,
) -> None:
    """Talk to a model in the terminal. /reset forgets the conversation; /exit or Ctrl-D quits."""
    from rich.console import Console

    from dsv3.infer.chat_template import render, stop_strings
    from dsv3.infer.engine import Request
    from dsv3.infer.loading import encode
    from dsv3.infer.sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    engine = build_engine(model, dtype, weights, "auto", speculative, require_tokenizer=True, threads=threads)
    console = Console(stderr=True)
    console.print(f"[bold]dsv3 chat[/bold] with {Path(model).name}: /reset, /exit")
    history = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        history.append({"role": "user", "content": line})
        ids = encode(engine.tokenizer, render(history, engine.tokenizer))
        request = Request(ids, max_new_tokens, params, stop_strings=stop_strings(engine.tokenizer))
        sys.stdout.write("assistant> ")
        reply = []
        for ev in engine.stream([request]):
            reply.append(ev.text)
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply).strip()})


@serve_app.command()
def serve(
    model: str = MODEL,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Most requests decoded together."),
    speculative: str = SPECULATIVE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    cache_dtype: str = CACHE_DTYPE,
    threads: int = THREADS,
) -> None:
    """OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (stream: true as SSE)."""
    import uvicorn

    from dsv3.infer.server import create_app

    engine = build_engine(model, dtype, weights, cache_dtype, speculative, threads=threads)
    name = Path(model).name if Path(model).name not in ("", ".", "..") else Path(model).resolve().name
    app = create_app(engine, model_name=name, max_batch=max_batch)
    uvicorn.run(app, host=host, port=port, log_level="warning")
