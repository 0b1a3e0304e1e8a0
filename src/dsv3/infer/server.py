"""OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions.

``stream: true`` answers with server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
Every error is a 4xx/5xx with OpenAI's JSON body ``{"error": {"message", "type", "param", "code"}}``.
A client that disconnects cancels its request, and the scheduler drops it from the batch.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from dsv3.errors import DSV3Error
from dsv3.infer import chat_template
from dsv3.infer.engine import Engine, Event
from dsv3.infer.engine import Request as GenRequest
from dsv3.infer.sampling import SamplingParams
from dsv3.infer.scheduler import Scheduler


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (not in OpenAI's API)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Common):
    prompt: str | list[int]


class Message(BaseModel):
    role: str
    content: str


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def create_app(engine: Engine, model_name: str = "dsv3", max_batch: int = 8) -> FastAPI:
    """The API over one engine; the decode worker runs while the app is up."""
    scheduler = Scheduler(engine, max_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="dsv3", lifespan=lifespan)
    app.state.scheduler = scheduler
    _install_error_handlers(app)
    context = engine.model.config.max_position_embeddings

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "active": scheduler.active, "queued": scheduler.pending.qsize()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dsv3"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        _check_model(body.model, model_name)
        ids = body.prompt if isinstance(body.prompt, list) else _encode(engine, body.prompt)
        request = _request(engine, body, ids, body.max_tokens or 16, (), context)
        return await _respond(scheduler, http, request, body.stream, _CompletionShape(model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        _check_model(body.model, model_name)
        if engine.tokenizer is None:
            raise DSV3Error("this model has no tokenizer.json, so it cannot chat; use /v1/completions with token ids")
        prompt = chat_template.render([m.model_dump() for m in body.messages], engine.tokenizer)
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        request = _request(engine, body, _encode(engine, prompt), max_tokens,
                           chat_template.stop_strings(engine.tokenizer), context)
        return await _respond(scheduler, http, request, body.stream, _ChatShape(model_name))

    return app


# ---- requests --------------------------------------------------------------------------------

def _check_model(asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise HTTPException(404, f"model {asked!r} not found; this server serves {served!r}")


def _encode(engine: Engine, text: str) -> list[int]:
    if engine.tokenizer is None:
        raise DSV3Error("this model has no tokenizer.json; send the prompt as a list of token ids")
    return engine.tokenizer.encode(text).ids


def _request(engine: Engine, body: _Common, ids: list[int], max_tokens: int, extra_stops: tuple[str, ...],
             context: int) -> GenRequest:
    vocab = engine.model.config.vocab_size
    if not ids:
        raise DSV3Error("the prompt is empty")
    if any(not 0 <= i < vocab for i in ids):
        raise DSV3Error(f"prompt token ids must lie in [0, {vocab})")
    if len(ids) + max_tokens > context:
        raise DSV3Error(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                        f"context of {context} tokens")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if stops and engine.tokenizer is None:
        raise DSV3Error("stop strings need a tokenizer; this model has none")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
    return GenRequest(ids, max_tokens, params, stop_strings=tuple(stops) + extra_stops)


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
                raise item
            yield item
            if item.finish_reason:
                return
    finally:
        request.cancelled = True  # a no-op when it already finished


async def _respond(scheduler: Scheduler, http: Request, request: GenRequest, stream: bool, shape):
    rid, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    if stream:
        return StreamingResponse(_sse(scheduler, http, request, shape, rid, created),
                                 media_type="text/event-stream")
    text, count, reason = [], 0, "length"
    async for ev in _events(scheduler, http, request):
        text.append(ev.text)
        count += len(ev.token_ids)
        reason = ev.finish_reason or reason
    usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": count,
             "total_tokens": len(request.prompt_ids) + count}
    return {**shape.head(rid, created, final=True), "choices": [shape.final(("".join(text)), reason)],
            "usage": usage}


async def _sse(scheduler, http, request, shape, rid, created) -> AsyncIterator[str]:
    head = shape.head(rid, created, final=False)
    first = True
    async for ev in _events(scheduler, http, request):
        reason = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
        if ev.text or reason or first:
            yield f"data: {json.dumps({**head, 'choices': [shape.delta(ev.text, reason, first)]})}\n\n"
            first = False
    yield "data: [DONE]\n\n"


class _CompletionShape:
    prefix = "cmpl"

    def __init__(self, model: str):
        self.model = model

    def head(self, rid: str, created: int, final: bool) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model}

    def final(self, text: str, reason: str) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    def delta(self, text: str, reason: str | None, first: bool) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}


class _ChatShape(_CompletionShape):
    prefix = "chatcmpl"

    def head(self, rid: str, created: int, final: bool) -> dict:
        kind = "chat.completion" if final else "chat.completion.chunk"
        return {"id": rid, "object": kind, "created": created, "model": self.model}

    def final(self, text: str, reason: str) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": None}

    def delta(self, text: str, reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}


# ---- errors ------------------------------------------------------------------------------------

def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request",
                      param=where or None)

    @app.exception_handler(DSV3Error)
    async def bad_input(_, exc: DSV3Error):
        return _error(400, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        return _error(500, f"internal error: {exc}", "server_error")
