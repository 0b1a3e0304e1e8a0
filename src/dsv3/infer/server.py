"""OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions, and
/metrics (Prometheus text format: requests, tokens, latencies, batch size, prefix cache, expert load).

``stream: true`` answers with server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens the prefix cache served, as
OpenAI reports it. ``ignore_eos: true`` (vLLM's extension) generates exactly ``max_tokens`` tokens
unless a stop string ends it first: what ``dsv3 bench serve`` asks for.
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
from dsv3.infer import chat_template
from dsv3.infer.detok import token_text_and_bytes
from dsv3.infer.engine import Engine, Event, TokenLogprob
from dsv3.infer.engine import Request as GenRequest
from dsv3.infer.metrics import RouterCounts, ServingMetrics
from dsv3.infer.sampling import MAX_SEED, SamplingParams
from dsv3.infer.scheduler import Scheduler

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
MAX_STOPS, MAX_STOP_CHARS = 16, 512
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # "0.5" is not a number, nor true a 1

# OpenAI fields this server does not implement, with the values that mean "not used" (accepted).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "n": (None, 1),
}
# Fields that do not change what is generated (bookkeeping for the client's side): accepted and unused.
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                      "prompt_cache_key"})


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
    content: str | list[ContentPart]
    name: str | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


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
        request = _request(engine, body, ids, body.max_tokens, 16, (), body.logprobs)
        offset = len(body.prompt) if isinstance(body.prompt, str) else 0
        shape = _CompletionShape(model_name, engine.tokenizer, body.logprobs is not None, offset)
        return await _respond(scheduler, http, request, body, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        _check_body(body, model_name)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if engine.tokenizer is None:
            raise DSV3Error("this model has no tokenizer.json, so it cannot chat; use /v1/completions with token ids")
        prompt = chat_template.render(_messages(body.messages), engine.tokenizer, engine.chat_template)
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        ids = chat_template.encode_prompt(engine.tokenizer, prompt)
        request = _request(engine, body, ids, body.max_completion_tokens or body.max_tokens,
                           256, chat_template.stop_strings(engine.tokenizer, engine.chat_template), n_top)
        shape = _ChatShape(model_name, engine.tokenizer, body.logprobs)
        return await _respond(scheduler, http, request, body, shape)

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


def _messages(messages: list[Message]) -> list[dict[str, str]]:
    """Plain role/content dicts for the chat template: text parts joined, other parts refused by name;
    "developer" is OpenAI's newer name for "system"."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in (*chat_template.ROLES, "developer"):
            raise RequestError(f"messages.{i}.role: {m.role!r} is not supported (use system, user or assistant)",
                               f"messages.{i}.role")
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
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


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


def _request(engine: Engine, body: _Common, ids: list[int], max_tokens: int | None, default_max: int,
             extra_stops: tuple[str, ...], logprobs: int | None) -> GenRequest:
    """The engine request, after every check that could otherwise fail inside the shared batch."""
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
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
    return GenRequest(ids, max_tokens, params, stop_strings=tuple(stops) + extra_stops, logprobs=logprobs,
                      ignore_eos=body.ignore_eos)


async def _events(scheduler: Scheduler, http: Request, request: GenRequest) -> AsyncIterator[Event]:
    """The request's events; cancels it when the client goes away or the consumer stops early."""
    queue = scheduler.submit(request)
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            if isinstance(item, BaseException):
                raise GenerationError(f"generation failed: {item}") from item
            if item.finish_reason == "error":
                raise GenerationError(item.error or "generation failed")
            yield item
            if item.finish_reason:
                return
    finally:
        request.cancelled = True  # a no-op when it already finished


def _usage(request: GenRequest, count: int) -> dict:
    return {"prompt_tokens": len(request.prompt_ids), "completion_tokens": count,
            "total_tokens": len(request.prompt_ids) + count,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}


def _count_tokens(http: Request, count: int) -> None:
    """Tell the access log how many tokens this request generated."""
    info = http.scope.get(AccessLog.KEY)
    if info is not None:
        info["tokens"] = count


async def _respond(scheduler: Scheduler, http: Request, request: GenRequest, body: _Common, shape):
    rid, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(scheduler, http, request, shape, rid, created, usage),
                                 media_type="text/event-stream")
    text, count, reason, logprobs = [], 0, "length", []
    async for ev in _events(scheduler, http, request):
        text.append(ev.text)
        count += len(ev.token_ids)
        _count_tokens(http, count)
        reason = ev.finish_reason or reason
        logprobs += ev.logprobs or []
    return {**shape.head(rid, created, final=True), "choices": [shape.final("".join(text), reason, logprobs)],
            "usage": _usage(request, count)}


async def _sse(scheduler, http, request, shape, rid, created, include_usage: bool) -> AsyncIterator[str]:
    head = shape.head(rid, created, final=False)
    first, count = True, 0
    try:
        async for ev in _events(scheduler, http, request):
            count += len(ev.token_ids)
            _count_tokens(http, count)
            reason = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
            if ev.text or reason or first or ev.logprobs:
                chunk = shape.delta(ev.text, reason, first, ev.logprobs)
                yield f"data: {json.dumps({**head, 'choices': [chunk]})}\n\n"
                first = False
    except GenerationError as exc:  # the status line is sent already: the error travels in the stream
        yield f"data: {json.dumps(_error_body(str(exc), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(request, count)})}\n\n"
    yield "data: [DONE]\n\n"


# ---- response shapes ---------------------------------------------------------------------------

class _CompletionShape:
    """/v1/completions: text, and logprobs in the legacy layout (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    prefix = "cmpl"

    def __init__(self, model: str, tokenizer=None, logprobs: bool = False, offset: int = 0):
        self.model, self.tokenizer, self.logprobs = model, tokenizer, logprobs
        self.offset = offset  # text_offset of the next token (counted from the prompt's start)

    def head(self, rid: str, created: int, final: bool) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model}

    def final(self, text: str, reason: str, logprobs: list[TokenLogprob]) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": self._logprobs(logprobs)}

    def delta(self, text: str, reason: str | None, first: bool, logprobs: list[TokenLogprob] | None) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": self._logprobs(logprobs or [])}

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

    def head(self, rid: str, created: int, final: bool) -> dict:
        kind = "chat.completion" if final else "chat.completion.chunk"
        return {"id": rid, "object": kind, "created": created, "model": self.model}

    def final(self, text: str, reason: str, logprobs: list[TokenLogprob]) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": self._logprobs(logprobs)}

    def delta(self, text: str, reason: str | None, first: bool, logprobs: list[TokenLogprob] | None) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": self._logprobs(logprobs or [])}

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
