"""`dsv3 bench serve`: load on a running OpenAI-compatible server, in the manner of vLLM's
benchmark_serving.

R streaming requests go to ``/v1/completions``, at most C at a time. Each prompt is L random token ids
(the vocabulary size comes from the server's ``/v1/models`` card, or ``--vocab-size``); the first K are
the same in every prompt (``--shared-prefix``), which is what a prefix cache reuses. Each asks for
exactly N tokens (``--new-tokens``, ``ignore_eos``). Time to first token (TTFT) is measured from sending the request to
the first streamed chunk, time per output token (TPOT) over the rest of the stream; the server's
``usage`` (``stream_options.include_usage``) gives the token counts and the cached prompt tokens.

Only the standard library: the client must not share the server's dependencies or its process.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import typer

from dsv3.errors import DSV3Error

WIDTH = 80


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    ttft: float | None = None  # seconds
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def base_url(url: str) -> str:
    """'http://host:port' from what a user may give (a trailing /v1 or slash included)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DSV3Error(f"--url must look like http://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise DSV3Error(f"--url has a bad port: {url!r} ({exc})") from None
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def model_card(base: str, name: str | None = None, timeout: float = 10.0) -> dict:
    """The server's card of model ``name`` (default: its first); one clear error when the server cannot be
    reached or does not serve it."""
    try:
        data = _get_json(base + "/v1/models", timeout)
    except urllib.error.HTTPError as exc:
        raise DSV3Error(f"{base}/v1/models answered HTTP {exc.code}: is this an OpenAI-compatible server?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DSV3Error(f"cannot reach a server at {base}: {reason}") from None
    except ValueError:
        raise DSV3Error(f"{base}/v1/models did not answer JSON: is this an OpenAI-compatible server?") from None
    models = data.get("data") if isinstance(data, dict) else None
    cards = [m for m in models or [] if isinstance(m, dict) and "id" in m]
    if not cards:
        raise DSV3Error(f"{base}/v1/models lists no model")
    if name is None:
        return cards[0]
    for card in cards:
        if card["id"] == name:
            return card
    raise DSV3Error(f"the server at {base} does not serve {name!r}; it serves {', '.join(c['id'] for c in cards)}")


def make_prompts(n: int, length: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids whose first ``shared`` ids are the same."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(length - shared)] for _ in range(n)]


def stream_completion(base: str, model: str, prompt: list[int], gen_len: int, timeout: float,
                      on_token: Callable[[float], bool] | None = None) -> Outcome:
    """One streamed completion, timed; failures become an Outcome with ``error``, never an exception.
    ``on_token``: called with the arrival time (``time.perf_counter``) of every chunk that carries text; when
    it returns False the stream is closed there (the server then cancels the request)."""
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    usage, chunks = None, 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(False, error=str(chunk["error"].get("message", chunk["error"])))
                if chunk.get("choices"):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
                    if on_token is not None and not on_token(now):
                        break
                usage = chunk.get("usage") or usage
    except urllib.error.HTTPError as exc:
        return Outcome(False, error=f"HTTP {exc.code}: {_error_message(exc)}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")
    if first is None:
        return Outcome(False, error="the stream ended without a token")
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(True, ttft=first - t0, latency=last - t0, output_tokens=int(usage.get("completion_tokens", chunks)),
                   prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
                   cached_tokens=int(details.get("cached_tokens") or 0))


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except Exception:
        return exc.reason


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(values: list[float]) -> dict:
    return {"mean": 1000 * sum(values) / len(values) if values else None,
            "p50": _scale(percentile(values, 50)), "p99": _scale(percentile(values, 99))}


def _scale(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """Throughput, latency percentiles and cache reuse over the requests that completed."""
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in done)
    prompt_tokens = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    errors = [o.error for o in outcomes if not o.ok]
    return {
        "completed": len(done), "errors": len(errors), "error_messages": sorted(set(errors))[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "total_prompt_tokens": prompt_tokens, "total_output_tokens": out_tokens, "cached_tokens": cached,
        "cached_token_share": cached / prompt_tokens if prompt_tokens else None,
        "cached_tokens_per_request": [o.cached_tokens for o in done],
        "ttft_ms": _ms([o.ttft for o in done]),
        "ttft_ms_cached": _ms([o.ttft for o in done if o.cached_tokens]),
        "ttft_ms_uncached": _ms([o.ttft for o in done if not o.cached_tokens]),
        "tpot_ms": _ms([o.tpot for o in done if o.tpot is not None]),
    }


def run(base: str, model: str, prompts: list[list[int]], gen_len: int, concurrency: int, timeout: float) -> dict:
    """Send every prompt, at most ``concurrency`` at a time; the summary of what came back."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(lambda p: stream_completion(base, model, p, gen_len, timeout), prompts))
    return summarize(outcomes, time.perf_counter() - t0)


def main(
    url: str = typer.Option(..., "--url", metavar="URL", help="The server, e.g. http://127.0.0.1:8000."),
    model: str | None = typer.Option(None, "--model", metavar="NAME",
                                     help="Model to ask for (default: the first the server lists)."),
    concurrency: int = typer.Option(1, "--concurrency", metavar="C", show_default=False,
                                    help="Requests in flight at once (default: 1)."),
    requests: int = typer.Option(16, "--requests", metavar="R", show_default=False,
                                 help="Requests in all (default: 16)."),
    prompt_len: int = typer.Option(256, "--prompt-len", metavar="L", show_default=False,
                                   help="Prompt tokens per request (default: 256)."),
    gen_len: int = typer.Option(32, "--new-tokens", metavar="N", show_default=False,
                                help="Tokens generated per request, end-of-text ignored (default: 32)."),
    shared_prefix: int = typer.Option(0, "--shared-prefix", metavar="K", show_default=False,
                                      help="Leading prompt tokens every request shares (default: 0)."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", metavar="V",
                                          help="Draw token ids below V (default: the server's vocab_size)."),
    seed: int = typer.Option(0, "--seed", metavar="N", show_default=False, help="Prompt seed (default: 0)."),
    timeout: float = typer.Option(600.0, "--timeout", metavar="S", show_default=False,
                                  help="Seconds one request may take (default: 600)."),
    as_json: bool = typer.Option(False, "--json", metavar="", help="Print one JSON object."),
) -> None:
    """Throughput and latency (TTFT, TPOT p50/p99) of a running server under load."""
    for value, low, flag in ((concurrency, 1, "--concurrency"), (requests, 1, "--requests"),
                             (prompt_len, 1, "--prompt-len"), (gen_len, 1, "--new-tokens"),
                             (shared_prefix, 0, "--shared-prefix"), (seed, 0, "--seed")):
        if value < low:
            raise DSV3Error(f"{flag} must be >= {low}, got {value}")
    if shared_prefix > prompt_len:
        raise DSV3Error(f"--shared-prefix ({shared_prefix}) cannot exceed --prompt-len ({prompt_len})")
    if not timeout > 0:
        raise DSV3Error(f"--timeout must be > 0, got {timeout}")
    base = base_url(url)
    card = model_card(base, model)
    vocab = vocab_size if vocab_size is not None else card.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise DSV3Error("the server does not report its vocab_size: pass --vocab-size")
    context = card.get("max_model_len")
    if isinstance(context, int) and prompt_len + gen_len > context:
        raise DSV3Error(f"--prompt-len + --new-tokens ({prompt_len + gen_len}) exceeds the model's context ({context})")
    warm = stream_completion(base, card["id"], make_prompts(1, 4, 0, vocab, seed + 1)[0], 2, timeout)
    if not warm.ok:
        raise DSV3Error(f"the server at {base} cannot serve a test request: {warm.error}")
    prompts = make_prompts(requests, prompt_len, shared_prefix, vocab, seed)
    summary = run(base, card["id"], prompts, gen_len, concurrency, timeout)
    result = {"url": base, "model": card["id"], "concurrency": concurrency, "requests": requests,
              "prompt_len": prompt_len, "gen_len": gen_len, "shared_prefix": shared_prefix, **summary}
    print(json.dumps(result) if as_json else "\n".join(report_lines(result)))
    if not summary["completed"]:
        raise DSV3Error(f"every request failed: {summary['error_messages'][0]}")


def report_lines(r: dict) -> list[str]:
    """The human report: labelled rows, none wider than 80 columns."""
    def num(x, fmt: str = ",.1f") -> str:
        return "-" if x is None else format(x, fmt)

    rows = [
        ("Requests completed / failed", f"{r['completed']} / {r['errors']}"),
        ("Concurrency", str(r["concurrency"])),
        ("Prompt / shared prefix / generated", f"{r['prompt_len']} / {r['shared_prefix']} / {r['gen_len']} tokens"),
        ("Duration", f"{num(r['duration_s'], ',.2f')} s"),
        ("Request throughput", f"{num(r['request_throughput'], ',.2f')} req/s"),
        ("Output token throughput", f"{num(r['output_tokens_per_s'])} tokens/s"),
        ("Cached prompt tokens", f"{r['cached_tokens']:,} ({num(_pct(r['cached_token_share']), '.1f')}%)"),
    ]
    for label, key in (("TTFT", "ttft_ms"), ("TTFT, prefix cached", "ttft_ms_cached"),
                       ("TTFT, not cached", "ttft_ms_uncached"), ("TPOT", "tpot_ms")):
        stats = r[key]
        if stats["p50"] is not None:
            rows.append((f"{label} p50 / p99", f"{num(stats['p50'])} / {num(stats['p99'])} ms"))
    title = f" dsv3 bench serve: {r['model']} at {r['url']} "
    lines = [title.center(WIDTH, "=")[:WIDTH]]
    lines += [f"{label + ':':<40}{value:>40}"[:WIDTH] for label, value in rows]
    for message in r["error_messages"]:
        lines.append(f"error: {message}"[:WIDTH])
    lines.append("=" * WIDTH)
    return lines


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
