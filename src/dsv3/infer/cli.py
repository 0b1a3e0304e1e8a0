"""`dsv3 generate`, `dsv3 chat`, `dsv3 serve`: thin commands over the engine.

``--model`` takes a checkpoint folder or a training run folder (its latest checkpoint). Numeric flags
are checked here rather than by typer's ranges, so that a bad value ends as one ``error:`` line and the
help stays readable at 80 columns.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import typer

from dsv3.errors import DSV3Error
from dsv3.infer.options import CACHE_DTYPE, CHAT_TEMPLATE, DRAFT_VOCAB, DTYPE, SPECULATIVE, THREADS, WEIGHTS
from dsv3.infer.units import parse_size
from dsv3.option_lists import parse_list

generate_app = typer.Typer(add_completion=False, help="Generate text from a checkpoint (latent-cache decode, MTP).")
chat_app = typer.Typer(add_completion=False, help="Chat with a checkpoint in the terminal.")
serve_app = typer.Typer(add_completion=False, help="Serve a checkpoint over an OpenAI-compatible HTTP API.")

MODEL = typer.Option(..., "--model", metavar="PATH",
                     help="Checkpoint folder, or a training run folder (its latest checkpoint).")
SEED = typer.Option(None, "--seed", metavar="N", help="Sampling seed, 0 to 2**64-1 (default: random).")


def at_least(value: int | float | None, low: int | float, flag: str) -> None:
    if value is not None and value < low:
        raise DSV3Error(f"{flag} must be >= {low}, got {value}")


def build_engine(model_dir: str, dtype: str, weights: str, cache_dtype: str, speculative: str,
                 ignore_eos: bool = False, tokenizer_needed_for: str | None = None, threads: int = 0,
                 draft_vocab: int = 0, experts: list[int] | None = None, chat_template: str | None = None,
                 kv_cache_bytes: str | None = None):
    """Model, tokenizer and engine from the shared command-line options. ``tokenizer_needed_for`` says
    why a tokenizer is required (the error names it), or None when it is optional. ``draft_vocab`` K > 0
    drafts over the checkpoint's K most frequent tokens (``draft_vocab.json``). ``experts``: the routed
    experts an expert-parallel rank loads (the others are never read). ``chat_template``: a Jinja file
    used instead of the checkpoint's chat template (``--chat-template``). ``kv_cache_bytes``: the latent
    cache's pages (``--kv-cache-bytes``; None: the engine's default)."""
    import torch

    at_least(threads, 0, "--threads")
    if threads:
        torch.set_num_threads(threads)
    from dsv3.data.chat_template import load_chat_template
    from dsv3.infer.engine import Engine
    from dsv3.infer.loading import eos_ids, load_model, load_tokenizer, parse_dtype
    from dsv3.run_dir import resolve_checkpoint

    if speculative not in ("mtp", "none"):
        raise DSV3Error(f"--speculative must be mtp or none, got {speculative!r}")
    at_least(draft_vocab, 0, "--draft-vocab")
    if draft_vocab and speculative != "mtp":
        raise DSV3Error("--draft-vocab restricts MTP drafts: it needs --speculative mtp")
    pool = {} if kv_cache_bytes is None else {"kv_cache_bytes": parse_size(kv_cache_bytes, "--kv-cache-bytes")}
    compute = parse_dtype(dtype, "--dtype", ("fp32", "bf16"))
    cache = parse_dtype(cache_dtype, "--cache-dtype", ("fp32", "bf16", "fp8"))
    folder = resolve_checkpoint(model_dir)
    tokenizer = load_tokenizer(folder, needed_for=tokenizer_needed_for)
    # a bad template fails here, before the weights load (without a tokenizer there is no chat to template)
    template = load_chat_template(folder, tokenizer, chat_template).checked() if tokenizer is not None else None
    model = load_model(folder, compute, weights, experts)
    eos = frozenset() if ignore_eos else eos_ids(model, tokenizer)
    vocab = None
    if draft_vocab:
        from dsv3.infer.draft_vocab import load

        vocab = load(folder, draft_vocab, model.config.vocab_size)
    return Engine(model, tokenizer, speculative=speculative == "mtp", cache_dtype=cache, eos_token_ids=eos,
                  draft_vocab=vocab, chat_template=template, **pool)


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
    ids = parse_list(text, "--prompt-ids", int, unique=False)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DSV3Error(f"--prompt-ids has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def fit_context(engine, prompt_tokens: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, or fewer with a warning on stderr when the prompt and the reply would not fit
    the model's context (positions past it were never trained and RoPE has no meaning there)."""
    limit = engine.context
    if limit is None:
        return max_new_tokens
    if prompt_tokens >= limit:
        raise DSV3Error(f"the prompt ({prompt_tokens} tokens) fills the model's context of {limit} tokens")
    room = limit - prompt_tokens
    if max_new_tokens > room:
        print(f"warning: --max-new-tokens {max_new_tokens} capped to {room}: the prompt ({prompt_tokens} tokens) "
              f"and the reply must fit the model's context of {limit} tokens", file=sys.stderr, flush=True)
        return room
    return max_new_tokens


@generate_app.command()
def generate(
    model: str = MODEL,
    prompt: str | None = typer.Option(None, "--prompt", metavar="TEXT", help="Prompt text (needs tokenizer.json)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", metavar="IDS", help="Prompt as token ids: 1,2,3."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", metavar="N", show_default=False,
                                       help="Most tokens to generate, capped at the model's context (default: 64)."),
    greedy: bool = typer.Option(False, "--greedy", metavar="", help="Always take the most likely token."),
    temperature: float | None = typer.Option(None, "--temperature", metavar="T", help="Default 1.0; 0 is greedy."),
    top_p: float | None = typer.Option(None, "--top-p", metavar="P", help="Nucleus sampling mass, (0, 1]."),
    top_k: int | None = typer.Option(None, "--top-k", metavar="K", help="Sample from the K likeliest only."),
    seed: int | None = SEED,
    speculative: str = SPECULATIVE,
    draft_vocab: int = DRAFT_VOCAB,
    stop: list[str] = typer.Option([], "--stop", metavar="TEXT", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", metavar="", help="Do not stop at end-of-sequence."),
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    cache_dtype: str = CACHE_DTYPE,
    threads: int = THREADS,
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object instead of streaming."),
) -> None:
    """Generate a continuation of one prompt, streaming it (or one JSON object with --json)."""
    from dsv3.infer.engine import Request
    from dsv3.infer.fp8_weights import resident_bytes
    from dsv3.infer.loading import encode

    if (prompt is None) == (prompt_ids is None):
        raise DSV3Error("give exactly one of --prompt or --prompt-ids")
    at_least(max_new_tokens, 1, "--max-new-tokens")
    at_least(top_k, 0, "--top-k")
    params = sampling_from_flags(greedy, temperature, top_p, top_k, seed)
    why = "--prompt" if prompt is not None else "--stop" if stop else None
    engine = build_engine(model, dtype, weights, cache_dtype, speculative, ignore_eos, tokenizer_needed_for=why,
                          threads=threads, draft_vocab=draft_vocab)
    ids = parse_ids(prompt_ids, engine.model.config.vocab_size) if prompt_ids else encode(engine.tokenizer, prompt)
    if not ids:
        raise DSV3Error("the prompt encodes to no tokens")
    allowed = fit_context(engine, len(ids), max_new_tokens)
    request = Request(ids, allowed, params, stop_strings=tuple(stop))
    tokens, text, reason, error = [], [], "length", None
    t0 = time.perf_counter()
    for ev in engine.stream([request]):
        tokens += ev.token_ids
        text.append(ev.text)
        reason = ev.finish_reason or reason
        error = ev.error or error
        if not as_json:
            _echo_stream(ev, engine.tokenizer)
    elapsed = time.perf_counter() - t0
    stats = engine.last_stats
    if as_json:
        out = {"text": "".join(text), "token_ids": tokens, "finish_reason": reason, "prompt_tokens": len(ids),
               "max_new_tokens": allowed, "capped_to_context": allowed < max_new_tokens,
               "tokens_per_s": len(tokens) / elapsed, "prefill_s": stats.prefill_s,
               "decode_tokens_per_s": stats.tokens / stats.decode_s if stats.decode_s else None,
               "cache_bytes": stats.cache_bytes, "weight_bytes": resident_bytes(engine.model),
               "speculative": speculative, "draft_vocab": draft_vocab or None}
        if error:
            out["error"] = error
        if engine.speculative:
            out["acceptance_rate"] = stats.acceptance_rate
            out["tokens_per_forward"] = stats.tokens_per_forward
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        _report(len(tokens), elapsed, stats, engine.speculative)
    if error:
        raise DSV3Error(error)


def _echo_stream(ev, tokenizer) -> None:
    if tokenizer is not None:
        sys.stdout.write(ev.text)
    elif ev.token_ids:
        sys.stdout.write(",".join(str(t) for t in ev.token_ids) + ",")
    sys.stdout.flush()


def _report(n_tokens: int, elapsed: float, stats, speculative: bool) -> None:
    from rich.console import Console

    from dsv3.infer.units import fmt_bytes

    line = f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s)"
    line += f", cache {fmt_bytes(stats.cache_bytes)}"
    if speculative and stats.acceptance_rate is not None:
        line += f", MTP acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_forward:.2f} tokens/forward"
    Console(stderr=True).print(f"[dim]{line}[/dim]")


@chat_app.command()
def chat(
    model: str = MODEL,
    system: str | None = typer.Option(None, "--system", metavar="TEXT", help="System prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", metavar="N", show_default=False,
                                       help="Most tokens per reply, capped at the model's context (default: 256)."),
    temperature: float = typer.Option(0.7, "--temperature", metavar="T", show_default=False,
                                      help="Sampling temperature; 0 is greedy (default: 0.7)."),
    top_p: float = typer.Option(0.95, "--top-p", metavar="P", show_default=False,
                                help="Nucleus sampling mass, (0, 1] (default: 0.95)."),
    seed: int | None = SEED,
    speculative: str = SPECULATIVE,
    draft_vocab: int = DRAFT_VOCAB,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    threads: int = THREADS,
    chat_template: str | None = CHAT_TEMPLATE,
) -> None:
    """Talk to a model in the terminal. /reset forgets the conversation; /exit or Ctrl-D quits."""
    from rich.console import Console

    from dsv3.infer.sampling import SamplingParams

    at_least(max_new_tokens, 1, "--max-new-tokens")
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    engine = build_engine(model, dtype, weights, "auto", speculative, tokenizer_needed_for="chat", threads=threads,
                          draft_vocab=draft_vocab, chat_template=chat_template)
    console = Console(stderr=True)
    console.print(f"[bold]dsv3 chat[/bold] with {_model_name(model)}: /reset, /exit")
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = list(base)
            continue
        reply = _chat_turn(engine, history + [{"role": "user", "content": line}], params, max_new_tokens)
        if reply is not None:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def _chat_turn(engine, history: list[dict[str, str]], params, max_new_tokens: int) -> str | None:
    """Answer the conversation, streaming; None when it no longer fits the context (nothing is kept)."""
    from dsv3.infer.chat_template import encode_prompt, render, stop_strings
    from dsv3.infer.engine import Request

    ids = encode_prompt(engine.tokenizer, render(history, engine.tokenizer, engine.chat_template))
    if engine.context is not None and len(ids) >= engine.context:
        print(f"the conversation ({len(ids)} tokens) no longer fits the model's context of {engine.context} "
              "tokens; /reset starts over", file=sys.stderr, flush=True)
        return None
    request = Request(ids, fit_context(engine, len(ids), max_new_tokens), params,
                      stop_strings=stop_strings(engine.tokenizer, engine.chat_template))
    sys.stdout.write("assistant> ")
    reply = []
    for ev in engine.stream([request]):
        reply.append(ev.text)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        if ev.error:
            print(f"\nerror: {ev.error}", file=sys.stderr, flush=True)
    sys.stdout.write("\n")
    return "".join(reply).strip()


def _model_name(model: str) -> str:
    """What the server calls the model: the folder's name as given (``latest``, or the run's name)."""
    path = Path(model)
    return path.name if path.name not in ("", ".", "..") else path.resolve().name


def listen(host: str, port: int) -> socket.socket:
    """A bound listening socket, so that the address can be printed (port 0 picks a free one) and a port in
    use is one clear error rather than a log line from deep inside the server."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise DSV3Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


# serve's whole-prefill budget between two decode steps, measured: benchmarks/chunked_prefill.py and
# benchmarks/serve_vs_engine.py (docs/inference.md)
MAX_PREFILL_TOKENS = 256


@serve_app.command()
def serve(
    model: str = MODEL,
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDR", show_default=False,
                             help="Address to listen on (default: 127.0.0.1, this machine only)."),
    port: int = typer.Option(8000, "--port", metavar="N", show_default=False,
                             help="Port (default: 8000; 0 picks a free one)."),
    max_batch: int = typer.Option(8, "--max-batch", metavar="N", show_default=False,
                                  help="Most requests decoded together (default: 8)."),
    speculative: str = SPECULATIVE,
    draft_vocab: int = DRAFT_VOCAB,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
    cache_dtype: str = CACHE_DTYPE,
    threads: int = THREADS,
    chat_template: str | None = CHAT_TEMPLATE,
    quiet: bool = typer.Option(False, "--quiet", metavar="", help="No access log line per request."),
    api_key: str | None = typer.Option(None, "--api-key", metavar="KEY", envvar="DSV3_API_KEY", show_default=False,
                                       show_envvar=False, help="Answer /v1 requests only with 'Authorization: "
                                                               "Bearer KEY' (default: $DSV3_API_KEY, or open)."),
    kv_cache_bytes: str | None = typer.Option(None, "--kv-cache-bytes", metavar="SIZE", show_default=False,
                                       help="Memory for the latent cache of running requests and cached "
                                            "prefixes, e.g. 8G: taken as used (default: 4GiB)."),
    prefix_cache_bytes: str | None = typer.Option(None, "--prefix-cache-bytes", metavar="SIZE", show_default=False,
                                           help="Memory for cached prompt prefixes, e.g. 512M; 0 turns the "
                                                "cache off (default: 1G; with --ep, per prefilling rank)."),
    prefix_block_tokens: int = typer.Option(16, "--prefix-block-tokens", metavar="N", show_default=False,
                                            help="Tokens per prefix-cache block (default: 16)."),
    prefix_cache_dir: str | None = typer.Option(None, "--prefix-cache-dir", metavar="DIR",
                                                help="Keep evicted prefix blocks in this folder and reuse them."),
    max_prefill_tokens: int | None = typer.Option(None, "--max-prefill-tokens", metavar="N", show_default=False,
                                                  help="Most prompt tokens prefilled whole between two decode "
                                                       "steps (waiting prompts that fit go together); a longer "
                                                       "prompt is prefilled in chunks, each sized to take about "
                                                       "one decode step's time, so streams that are decoding "
                                                       "keep going; 0 prefills whole prompts "
                                                       f"(default: {MAX_PREFILL_TOKENS})."),
    prefill_threads: int = typer.Option(0, "--prefill-threads", metavar="N", show_default=False,
                                        help="CPU threads of its own for a prompt longer than "
                                             "--max-prefill-tokens, prefilled while the decode steps go on; "
                                             "give it cores --threads leaves free (default: 0, its chunks "
                                             "ride the decode steps)."),
    ep: int | None = typer.Option(None, "--ep", metavar="N", show_default=False,
                                  help="Expert parallel over N processes started by dsv3 launch --nproc N."),
    prefill_ranks: int = typer.Option(0, "--prefill-ranks", metavar="P", show_default=False,
                                      help="With --ep: the first P ranks prefill, the others decode (default: 0)."),
    dispatch: str = typer.Option("native", "--dispatch", metavar="FMT", show_default=False,
                                 help="With --ep: dispatch wire format native, bf16, fp8 or fp32 (default: native)."),
    combine: str = typer.Option("native", "--combine", metavar="FMT", show_default=False,
                                help="With --ep: combine wire format native, bf16, logfmt8, logfmt10 or fp32 "
                                     "(default: native)."),
    redundant_experts: int = typer.Option(0, "--redundant-experts", metavar="R", show_default=False,
                                          help="With --ep: R extra expert slots per layer for replicas (EPLB)."),
    eplb_every: int = typer.Option(0, "--eplb-every", metavar="K", show_default=False,
                                   help="With --ep: rebalance experts from the observed load every K busy steps."),
    micro_batches: int = typer.Option(1, "--micro-batches", metavar="N", show_default=False,
                                      help="With --ep: 2 splits each decode step into two halves, one computing "
                                           "while the other's expert exchange is in flight (default: 1)."),
) -> None:
    """OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (stream: true as SSE),
    /metrics (Prometheus). Prints the address and the model on start, then one access log line per
    request on stderr."""
    import uvicorn

    from dsv3.infer.server import create_app
    from dsv3.run_dir import resolve_checkpoint

    at_least(max_batch, 1, "--max-batch")
    at_least(max_prefill_tokens, 0, "--max-prefill-tokens")
    at_least(prefill_threads, 0, "--prefill-threads")
    if prefill_threads and max_prefill_tokens == 0:
        raise DSV3Error("--prefill-threads prefills prompts longer than --max-prefill-tokens beside the decode "
                        "steps: --max-prefill-tokens 0 prefills every prompt whole between them")
    if not 0 <= port <= 65535:
        raise DSV3Error(f"--port must be in [0, 65535], got {port}")
    if ep is not None:
        from dsv3.infer.cluster.serve import GroupOptions, serve_group

        if max_prefill_tokens is not None or prefill_threads:
            flag = "--max-prefill-tokens" if max_prefill_tokens is not None else "--prefill-threads"
            raise DSV3Error(f"--ep N prefills whole prompts for now: drop {flag} (it would be ignored)")
        check_prefix_flags(prefix_cache_bytes or "1G", prefix_block_tokens, prefix_cache_dir)
        engine_args = dict(dtype=dtype, weights=weights, cache_dtype=cache_dtype, speculative=speculative,
                           threads=threads, draft_vocab=draft_vocab, chat_template=chat_template,
                           kv_cache_bytes=kv_cache_bytes)
        opts = GroupOptions(ep, prefill_ranks, dispatch, combine, redundant_experts, eplb_every, micro_batches,
                            prefix_cache_bytes or "1G", prefix_block_tokens, prefix_cache_dir)
        serve_group(opts, model, host, port, max_batch, engine_args, quiet, api_key)
        return
    if prefill_ranks or dispatch != "native" or combine != "native" or redundant_experts or eplb_every or \
            micro_batches != 1:
        raise DSV3Error("--prefill-ranks, --dispatch, --combine, --redundant-experts, --eplb-every and "
                        "--micro-batches need --ep N (several processes)")
    folder = resolve_checkpoint(model)
    engine = build_engine(str(folder), dtype, weights, cache_dtype, speculative, threads=threads,
                          draft_vocab=draft_vocab, chat_template=chat_template, kv_cache_bytes=kv_cache_bytes)
    attach_prefix_cache(engine, prefix_cache_bytes or "1G", prefix_block_tokens, prefix_cache_dir)
    engine.max_prefill_tokens = (MAX_PREFILL_TOKENS if max_prefill_tokens is None else max_prefill_tokens) or None
    engine.prefill_threads = beside_threads(engine, prefill_threads, threads)
    name = _model_name(model)
    app = create_app(engine, model_name=name, max_batch=max_batch, access_log=None if quiet else _log_line,
                     api_key=api_key)
    sock = listen(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    where = f"[{bound_host}]" if ":" in bound_host else bound_host
    _log_line(f"dsv3 serve: model {name!r} from {folder} ({_describe(engine)})")
    _log_line(f"listening on http://{where}:{bound_port}/v1 (OpenAI API); Ctrl-C stops")
    # uvloop and httptools (dependencies where they build) run the HTTP thread's loop and parser in C: each
    # step's hand-over to that loop (scheduler.deliver_all) then wakes it from C, keeping the GIL, where
    # asyncio's self-pipe write lets go of it and the decode thread waits for the HTTP thread's Python
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="auto", http="auto"))
    run_beside(server, sock, app.state.scheduler)


def run_beside(server, sock, scheduler) -> None:
    """The HTTP server on a thread of its own and the decode loop on this, the main, thread
    (``Scheduler.drive`` says why). Ctrl-C or SIGTERM stops the server as uvicorn does on its own (no new
    connections; the requests in flight finish, the loop running until the server has stopped); a second
    one stops it without waiting for them."""
    import signal
    import threading

    def stop_serving(signum, frame):
        server.force_exit = server.should_exit
        server.should_exit = True

    from dsv3.infer.heap import loaded_heap_frozen

    scheduler.driven = True
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dsv3-http", daemon=True)
    before = {sig: signal.signal(sig, stop_serving) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with loaded_heap_frozen():
            http.start()
            scheduler.drive(until=lambda: not http.is_alive())
            http.join(timeout=30)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def check_prefix_flags(size: str, block_tokens: int, directory: str | None) -> int:
    """The prefix cache's budget in bytes from its flags, or the error that names the wrong one."""

    at_least(block_tokens, 1, "--prefix-block-tokens")
    max_bytes = parse_size(size, "--prefix-cache-bytes")
    if max_bytes == 0 and directory is not None:
        raise DSV3Error("--prefix-cache-dir needs a prefix cache: --prefix-cache-bytes must be > 0")
    return max_bytes


def attach_prefix_cache(engine, size: str, block_tokens: int, directory: str | None) -> None:
    """Give ``engine`` a prefix cache of ``size`` bytes (none for 0; a folder without memory is refused)."""
    from dsv3.infer.prefix_cache import PrefixCache

    max_bytes = check_prefix_flags(size, block_tokens, directory)
    if max_bytes:
        PrefixCache.for_engine(engine, max_bytes, block_tokens, directory)


def beside_threads(engine, prefill_threads: int, threads: int) -> int:
    """``--prefill-threads``, checked: a CPU engine's (another device runs one stream of work at a time), and a
    note when it and the decode's threads outnumber the cores (they would take turns on them)."""
    import torch

    from dsv3.infer.prefill_beside import usable_cpus

    if not prefill_threads:
        return 0
    if engine.device.type != "cpu":
        raise DSV3Error(f"--prefill-threads gives a prefill CPU threads of its own; this model runs on "
                        f"{engine.device.type}: drop it")
    cores, decode = usable_cpus(), threads or torch.get_num_threads()
    if decode + prefill_threads > cores:
        _log_line(f"note: {decode} decode + {prefill_threads} prefill threads on {cores} cores: prefills starve; "
                  f"try --threads {max(cores - prefill_threads, 1)}")
    return prefill_threads


def _log_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _describe(engine, params: int | None = None) -> str:
    """One line about the served model; ``params``: the whole model's count when this process holds part."""
    from dsv3.infer.units import fmt_bytes, fmt_count

    params = params if params is not None else sum(p.numel() for p in engine.model.parameters())
    dtype = str(next(engine.model.parameters()).dtype).replace("torch.", "")
    context = f"context {engine.context}" if engine.context else "no context limit in config.json"
    spec = ", MTP speculation" if engine.speculative else ""
    if engine.draft_vocab is not None:
        spec += f" over a {engine.draft_vocab.k}-token draft vocabulary"
    cache = engine.prefix_cache
    prefix = f", prefix cache {fmt_bytes(cache.max_bytes)}" if cache is not None else ""
    return f"{fmt_count(params)} parameters, {dtype}, {engine.device}, {context}{spec}{prefix}"
