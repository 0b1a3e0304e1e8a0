"""OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions, and
/metrics (Prometheus text format: requests, tokens, latencies, batch size, prefix cache, expert load).

``response_format`` (JSON object or schema) and ``tools`` with ``tool_choice`` follow OpenAI's API: see
``dsv3.infer.structured`` for what each asks, ``dsv3.infer.grammar`` for the constrained decoding and
``dsv3.infer.tool_calls`` for the DeepSeek-V3 tool-call format read into ``message.tool_calls``.

``stream: true`` answers with server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens the prefix cache served, as
OpenAI reports it. ``ignore_eos: true`` (vLLM's extension) generates exactly ``max_tokens`` tokens
unless a stop string ends it first: what ``dsv3 bench serve`` asks for. ``n`` choices are ``n`` rows of
the batch that share the prompt's prefill, choice i with its own random stream derived from ``seed`` and
i; the penalties, ``logit_bias`` and ``min_tokens`` are defined in ``dsv3.infer.penalties``.
Every error is a 4xx/5xx with OpenAI's JSON body ``{"error": {"message", "type", "param", "code"}}``.
A client that disconnects cancels its request, and the scheduler drops it from the batch.

One request never harms another: every field is checked before the request reaches the batch (types
strictly, ranges, the context), fields this server does not implement are refused by name rather than
ignored, and a failure that belongs to one request during decoding (non-finite logits, say) ends that
request alone: an HTTP 500 for it, or an ``error`` event in its stream, while the batch goes on.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from dsv3.errors import DSV3Error
from dsv3.infer import chat_template, structured
from dsv3.infer.detok import token_text_and_bytes
from dsv3.infer.engine import Engine, Event, TokenLogprob
from dsv3.infer.engine import Request as GenRequest
from dsv3.infer.grammar import Grammars
from dsv3.infer.metrics import RouterCounts, ServingMetrics
from dsv3.infer.sampling import MAX_SEED, SamplingParams
from dsv3.infer.scheduler import Scheduler
from dsv3.infer.tool_calls import ToolCallStream, message_calls, parse

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
MAX_CHOICES = 16  # n: each choice is a row of the shared batch
MAX_STOPS, MAX_STOP_CHARS = 16, 512
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # "0.5" is not a number, nor true a 1

# OpenAI fields this server does not implement, with the values that mean "not used" (accepted).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"),  # chat only: refused on /v1/completions
    "functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}
# Fields that do not change what is generated (bookkeeping for the client's side): accepted and unused.
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (not in OpenAI's API)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM's): only max_tokens and stop strings end the request
    response_format: dict[str, Any] | None = None  # checked by dsv3.infer.structured
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)  # extension (vLLM's)


class CompletionBody(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as this server returns them
    tool_call_id: str | None = None  # a tool result's call


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # checked by dsv3.infer.structured
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class RequestError(DSV3Error):
    """A 400 that names the offending field in the body's ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GenerationError(Exception):
    """This request's generation failed (a 500 for it alone)."""


def create_app(engine: Engine, model_name: str = "dsv3", max_batch: int = 8,
               access_log: Callable[[str], None] | None = None, metrics: ServingMetrics | None = None,
               scheduler: Scheduler | None = None, api_key: str | None = None) -> FastAPI:
    """The API over one engine; the decode worker runs while the app is up. ``access_log`` receives one
    line per request (method, path, status, tokens generated, milliseconds). ``metrics``: where /metrics
    reads from (by default one whose expert load counts this process's routers). ``scheduler``: another
    scheduler with the same interface (a multi-process serving group's front end; /metrics reads its own).
    ``api_key``: the /v1 routes answer only requests that carry it (``Authorization: Bearer KEY``)."""
    if scheduler is None:
        if metrics is None:
            metrics = ServingMetrics()
            metrics.expert_load = RouterCounts(engine.model) if engine.model.moe_layers() else None
        scheduler = Scheduler(engine, max_batch, metrics)
    metrics = scheduler.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        if isinstance(metrics.expert_load, RouterCounts):
            metrics.expert_load.remove()  # the model may outlive the app (tests, notebooks)

    app = FastAPI(title="dsv3", lifespan=lifespan)
    grammars = Grammars(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    app.state.scheduler = scheduler
    _install_error_handlers(app)
    if api_key:
        _require_key(app, api_key)
    if access_log is not None:
        app.add_middleware(AccessLog, write=access_log)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "active": scheduler.active, "queued": scheduler.pending.qsize()}

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "dsv3",
                "max_model_len": engine.context, "vocab_size": engine.model.config.vocab_size}  # as vLLM's card
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        _check_body(body, model_name)
        ids = body.prompt if isinstance(body.prompt, list) else _encode(engine, body.prompt)
        plans = _plans(body.n, lambda: structured.plan(grammars, body.response_format, ignore_eos=body.ignore_eos))
        requests = _requests(engine, body, ids, body.max_tokens, 16, (), body.logprobs, plans)
        offset = len(body.prompt) if isinstance(body.prompt, str) else 0
        shapes = [_CompletionShape(model_name, engine.tokenizer, body.logprobs is not None, offset, index=i)
                  for i in range(body.n)]
        return await _respond(scheduler, http, requests, body, shapes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        _check_body(body, model_name)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if engine.tokenizer is None:
            raise DSV3Error("this model has no tokenizer.json, so it cannot chat; use /v1/completions with token ids")
        plans = _plans(body.n, lambda: structured.plan(grammars, body.response_format, body.tools, body.tool_choice,
                                                      body.parallel_tool_calls, body.ignore_eos))
        prompt = chat_template.render(_messages(body.messages), engine.tokenizer, engine.chat_template,
                                      tools=body.tools or None)
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        ids = chat_template.encode_prompt(engine.tokenizer, prompt)
        requests = _requests(engine, body, ids, body.max_completion_tokens or body.max_tokens, 256,
                             chat_template.stop_strings(engine.tokenizer, engine.chat_template), n_top, plans)
        shapes = [_ChatShape(model_name, engine.tokenizer, body.logprobs, index=i, tools=plans[0].tool_calls)
                  for i in range(body.n)]
        return await _respond(scheduler, http, requests, body, shapes)

    return app


# ---- requests --------------------------------------------------------------------------------

def _check_body(body: _Common, served: str) -> None:
    """The model asked for, and every field that is not ours: harmless bookkeeping passes, a feature we
    do not implement is refused by name (silently ignoring ``tools`` would answer a different question)."""
    if body.model is not None and body.model != served:
        raise HTTPException(404, f"model {body.model!r} not found; this server serves {served!r}")
    for name, value in (body.model_extra or {}).items():
        if name in HARMLESS:
            continue
        if name not in UNSUPPORTED:
            raise RequestError(f"{name}: unrecognized field", name)
        if not any(value == ok and type(value) is not bool or value is ok for ok in UNSUPPORTED[name]):
            raise RequestError(f"{name}: not supported by this server", name)


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Plain role/content dicts for the chat template: text parts joined, other parts refused by name;
    "developer" is OpenAI's newer name for "system"; an assistant's ``tool_calls`` kept (content may then
    be null)."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in (*chat_template.ROLES, "developer"):
            raise RequestError(f"messages.{i}.role: {m.role!r} is not supported (use system, user, assistant or "
                               "tool)", f"messages.{i}.role")
        calls = _history_calls(m, i)
        if m.content is None and not calls:
            raise RequestError(f"messages.{i}.content: a {m.role} message needs content", f"messages.{i}.content")
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if part.type != "text":
                    raise RequestError(f"{where}.type: {part.type!r} content parts are not supported, only "
                                       "'text'", f"{where}.type")
                if part.text is None:
                    raise RequestError(f"{where}.text: a text part needs a string 'text'", f"{where}.text")
                parts.append(part.text)
            content = "".join(parts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content,
                    **({"tool_calls": calls} if calls else {}),
                    **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})})
    return out


def _history_calls(m: Message, i: int) -> list[dict] | None:
    """An assistant message's tool calls, each checked: ``{"type": "function", "function": {"name": str,
    "arguments": str}}`` (an ``id`` may come along)."""
    if m.tool_calls is None:
        return None
    if m.role != "assistant":
        raise RequestError(f"messages.{i}.tool_calls: only an assistant message has tool calls",
                           f"messages.{i}.tool_calls")
    for j, call in enumerate(m.tool_calls):
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise RequestError(f"messages.{i}.tool_calls.{j}: must be {{'type': 'function', 'function': {{'name': "
                               "str, 'arguments': str}}}}", f"messages.{i}.tool_calls.{j}")
    return m.tool_calls


def _encode(engine: Engine, text: str) -> list[int]:
    if engine.tokenizer is None:
        raise DSV3Error("this model has no tokenizer.json; send the prompt as a list of token ids")
    return engine.tokenizer.encode(text).ids


def _context(engine: Engine) -> int:
    """The model's context, or a clear 400 when its config gives none: no request can be bounded."""
    if engine.context is None:
        raise DSV3Error("the model's config.json has no usable max_position_embeddings, so the server cannot "
                        "bound a request's length; set it in config.json")
    return engine.context


def _plans(n: int, plan: Callable[[], structured.Plan]) -> list[structured.Plan]:
    """One generation plan per choice: a grammar's matcher follows one choice's tokens, so each choice
    compiles its own (the first call checks the request's fields)."""
    return [plan() for _ in range(n)]


def _requests(engine: Engine, body: _Common, ids: list[int], max_tokens: int | None, default_max: int,
              extra_stops: tuple[str, ...], logprobs: int | None, plans: list[structured.Plan]) -> list[GenRequest]:
    """The engine requests, one per choice (``n``), after every check that could otherwise fail inside the
    shared batch. Choice i samples from its own stream (``SamplingParams.for_choice``); all share the prompt,
    so they are prefilled once when admitted together."""
    vocab, context = engine.model.config.vocab_size, _context(engine)
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    if any(not 0 <= i < vocab for i in ids):
        raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
    if len(ids) >= context:
        raise RequestError(f"the prompt ({len(ids)} tokens) fills the model's context of {context} tokens",
                           "prompt")
    if max_tokens is None:  # not asked for: as many as fit, up to the usual default
        max_tokens = min(default_max, context - len(ids))
    if len(ids) + max_tokens > context:
        raise RequestError(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                           f"context of {context} tokens", "max_tokens")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        # every stop string is checked after every token of the shared batch: bound the work
        raise RequestError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    if stops and engine.tokenizer is None:
        raise RequestError("stop strings need a tokenizer; this model has none", "stop")
    if body.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                            logit_bias=_logit_bias(body.logit_bias, vocab))
    return [GenRequest(ids, max_tokens, params.for_choice(i), stop_strings=tuple(stops) + extra_stops,
                       logprobs=logprobs, ignore_eos=body.ignore_eos, logits_processors=plan.processors,
                       skip_special_tokens=not plan.tool_calls) for i, plan in enumerate(plans)]


def _logit_bias(given: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias in [-100, 100]) as sorted (id, bias) pairs."""
    pairs = []
    for key, bias in (given or {}).items():
        if not key.isdigit() or not int(key) < vocab:
            raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab})", "logit_bias")
        if not -100 <= bias <= 100:
            raise RequestError(f"logit_bias: the bias of token {key} must be in [-100, 100], got {bias}",
                               "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


async def _events(scheduler: Scheduler, http: Request, requests: list[GenRequest]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) as the requests' events arrive, all on one queue (an event names its request);
    cancels them all when the client goes away, one fails, or the consumer stops early. All are queued before
    the first event is awaited, so the scheduler admits the choices of one body together (and their prefill is
    shared). One plain ``get`` per event: the HTTP thread's work for every token is time taken from the decode
    step when the kernels' threads fill the cores."""
    events: asyncio.Queue = asyncio.Queue()
    for r in requests:
        scheduler.submit(r, events)
    choice, live = {id(r): i for i, r in enumerate(requests)}, len(requests)
    watch = asyncio.ensure_future(_note_disconnect(http, events))
    try:
        while live:
            item = await events.get()
            if item is _GONE:
                return
            if isinstance(item, BaseException):
                raise GenerationError(f"generation failed: {item}") from item
            if item.finish_reason == "error":
                raise GenerationError(item.error or "generation failed")
            yield choice[id(item.request)], item
            live -= bool(item.finish_reason)
    finally:
        watch.cancel()
        for r in requests:
            r.cancelled = True  # a no-op for those already finished


_GONE = object()  # on a response's event queue: its client went away
DISCONNECT_POLL_S = 0.5


async def _note_disconnect(http: Request, events: asyncio.Queue) -> None:
    """Put ``_GONE`` on ``events`` once the client has gone away, looked at every ``DISCONNECT_POLL_S`` (a
    response that is not streamed has nothing else listening for it)."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    events.put_nowait(_GONE)


def _usage(requests: list[GenRequest], count: int) -> dict:
    """OpenAI's usage: the prompt counted once however many choices; ``count`` tokens over all choices."""
    prompt = len(requests[0].prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count,
            "prompt_tokens_details": {"cached_tokens": requests[0].cached_tokens}}


def _count_tokens(http: Request, count: int) -> None:
    """Tell the access log how many tokens this request generated."""
    info = http.scope.get(AccessLog.KEY)
    if info is not None:
        info["tokens"] = count


async def _respond(scheduler: Scheduler, http: Request, requests: list[GenRequest], body: _Common, shapes: list):
    """The response to a body with one request per choice, and one response shape per choice."""
    rid, created = f"{shapes[0].prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(scheduler, http, requests, shapes, rid, created, usage),
                                 media_type="text/event-stream")
    n = len(requests)
    texts, reasons, logprobs, count = [[] for _ in range(n)], ["length"] * n, [[] for _ in range(n)], 0
    async for i, ev in _events(scheduler, http, requests):
        texts[i].append(ev.text)
        count += len(ev.token_ids)
        _count_tokens(http, count)
        reasons[i] = ev.finish_reason or reasons[i]
        logprobs[i] += ev.logprobs or []
    choices = [shape.final("".join(texts[i]), reasons[i], logprobs[i]) for i, shape in enumerate(shapes)]
    return {**shapes[0].head(rid, created, final=True), "choices": choices, "usage": _usage(requests, count)}


async def _sse(scheduler, http, requests, shapes, rid, created, include_usage: bool) -> AsyncIterator[str]:
    head = shapes[0].head(rid, created, final=False)
    first, count = [True] * len(requests), 0
    try:
        async for i, ev in _events(scheduler, http, requests):
            count += len(ev.token_ids)
            _count_tokens(http, count)
            reason = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
            if ev.text or reason or first[i] or ev.logprobs:
                chunk = shapes[i].delta(ev.text, reason, first[i], ev.logprobs)
                yield f"data: {json.dumps({**head, 'choices': [chunk]})}\n\n"
                first[i] = False
    except GenerationError as exc:  # the status line is sent already: the error travels in the stream
        yield f"data: {json.dumps(_error_body(str(exc), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(requests, count)})}\n\n"
    yield "data: [DONE]\n\n"


# ---- response shapes ---------------------------------------------------------------------------

class _CompletionShape:
    """/v1/completions: text, and logprobs in the legacy layout (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    prefix = "cmpl"

    def __init__(self, model: str, tokenizer=None, logprobs: bool = False, offset: int = 0, index: int = 0):
        self.model, self.tokenizer, self.logprobs, self.index = model, tokenizer, logprobs, index  # index: the choice
        self.offset = offset  # text_offset of the next token (counted from the prompt's start)

    def head(self, rid: str, created: int, final: bool) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model}

    def final(self, text: str, reason: str, logprobs: list[TokenLogprob]) -> dict:
        return {"index": self.index, "text": text, "finish_reason": reason, "logprobs": self._logprobs(logprobs)}

    def delta(self, text: str, reason: str | None, first: bool, logprobs: list[TokenLogprob] | None) -> dict:
        return {"index": self.index, "text": text, "finish_reason": reason, "logprobs": self._logprobs(logprobs or [])}

    def _text(self, token_id: int) -> str:
        return token_text_and_bytes(self.tokenizer, token_id)[0]

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        tokens = [self._text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [self._top(e) for e in entries], "text_offset": offsets}

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """text -> logprob of the best alternatives; where two tokens share a text, the likelier one."""
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(self._text(token_id), logprob)
        return top


class _ChatShape(_CompletionShape):
    """/v1/chat/completions: message or delta, and logprobs as ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``."""

    prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer=None, logprobs: bool = False, index: int = 0, tools: bool = False):
        super().__init__(model, tokenizer, logprobs, index=index)
        self.tool_stream = ToolCallStream() if tools else None  # tool calls read out of the text

    def head(self, rid: str, created: int, final: bool) -> dict:
        kind = "chat.completion" if final else "chat.completion.chunk"
        return {"id": rid, "object": kind, "created": created, "model": self.model}

    def final(self, text: str, reason: str, logprobs: list[TokenLogprob]) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_stream is not None:  # what a stream of the same text gives: the call section is not content
            parsed = parse(text)
            message["content"] = parsed.content
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content or None,
                           "tool_calls": message_calls(parsed.calls)}
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": self.index, "message": message, "finish_reason": reason, "logprobs": self._logprobs(logprobs)}

    def delta(self, text: str, reason: str | None, first: bool, logprobs: list[TokenLogprob] | None) -> dict:
        calls = []
        if self.tool_stream is not None:  # content before the calls, then OpenAI's tool-call deltas
            text, calls = self.tool_stream.push(text, final=reason is not None)
            reason = "tool_calls" if reason == "stop" and self.tool_stream.called else reason
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if calls:
            delta["tool_calls"] = calls
        return {"index": self.index, "delta": delta, "finish_reason": reason,
                "logprobs": self._logprobs(logprobs or [])}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = token_text_and_bytes(self.tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        content = [{**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}


# ---- access log ----------------------------------------------------------------------------------

class AccessLog:
    """ASGI middleware: one line per request once its response is complete (streams included):
    client, method, path, status, tokens generated, milliseconds."""

    KEY = "dsv3.access"

    def __init__(self, app, write: Callable[[str], None]):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info: dict[str, Any] = {"status": None, "tokens": None, "done": False}
        scope[self.KEY] = info
        t0 = time.perf_counter()

        async def logged_send(message) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                info["done"] = True

        try:
            await self.app(scope, receive, logged_send)
        finally:
            self.write(self._line(scope, info, time.perf_counter() - t0))

    @staticmethod
    def _line(scope, info: dict, seconds: float) -> str:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        tokens = "" if info["tokens"] is None else f' {info["tokens"]} tokens'
        status = info["status"] if info["status"] is not None else 500
        tail = "" if info["done"] else " (client gone)"
        return f'{who} "{scope["method"]} {scope["path"]}" {status}{tokens} {seconds * 1000:.0f} ms{tail}'


# ---- errors ------------------------------------------------------------------------------------

def _error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, param, code), status_code=status)


def _require_key(app: FastAPI, key: str) -> None:
    """The /v1 routes answer 401 with OpenAI's error body unless the request carries ``key`` as a bearer
    token (as OpenAI's clients send ``api_key``); /health and /metrics stay open, as in vLLM."""
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path.startswith("/v1/") and not secrets.compare_digest(given, expected):
            return _error(401, "Incorrect API key provided: send the server's key as 'Authorization: Bearer "
                               "KEY' (the OpenAI clients' api_key)", code="invalid_api_key")
        return await call_next(request)


def _field(loc: tuple) -> str:
    """'messages.0.content' from pydantic's location, without "body" and without union-member tags
    such as 'str' or 'list[int]'."""
    tags = ("str", "int", "float", "bool", "none")
    parts = [str(p) for p in loc if p != "body" and str(p) not in tags and "[" not in str(p)]
    return ".".join(parts)


def _body_problem(request: Request, error: dict) -> str | None:
    """What is wrong with the body as a whole, said plainly, when it is not a JSON object at all (pydantic
    would name a character offset as the field, or ask for "a valid dictionary"); None for a field's error."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the request body is not valid JSON{at}: {error.get('ctx', {}).get('error', 'cannot parse it')}"
    if loc == ("body",):
        kind = request.headers.get("content-type")
        if kind is None or not kind.split(";")[0].strip().endswith("json"):
            got = f"got Content-Type {kind!r}" if kind else "the request has no Content-Type"
            return f"send the body as a JSON object with 'Content-Type: application/json' ({got})"
        return "the request body must be a JSON object (with the request's fields), not " \
               f"{type(error.get('input')).__name__}"
    return None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        body_problem = _body_problem(request, first)
        if body_problem is not None:
            return _error(400, body_problem)
        where = _field(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        return _error(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(DSV3Error)
    async def bad_input(_, exc: DSV3Error):
        return _error(400, str(exc), param=getattr(exc, "param", None))

    @app.exception_handler(GenerationError)
    async def failed(_, exc: GenerationError):
        return _error(500, str(exc), "server_error")

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        return _error(500, f"internal error: {exc}", "server_error")
