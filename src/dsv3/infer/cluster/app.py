"""What the HTTP app of a serving group adds to the single-process one: HTTP 503 once the group is down.

A request whose generation failed because the group lost a rank is not the request's fault (500) nor the
client's (400): it is 503 Service Unavailable, with OpenAI's error body, and ``/health`` says so too, so a
load balancer stops sending work here.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dsv3.infer.cluster.frontend import ClusterDown, ClusterScheduler
from dsv3.infer.server import GenerationError


def unavailable(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}
    return JSONResponse(body, status_code=503)


def install_unavailable(app: FastAPI, scheduler: ClusterScheduler) -> None:
    """Answer 503 for generations that failed with ClusterDown, and on /health once the group is down; GET
    /cluster describes the group (ranks, requests per rank, status)."""
    failed_before = app.exception_handlers.get(GenerationError)

    async def failed(request: Request, exc: GenerationError):
        if isinstance(exc.__cause__, ClusterDown):
            return unavailable(str(exc.__cause__))
        if failed_before is not None:
            return await failed_before(request, exc)
        body = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(GenerationError, failed)

    @app.get("/cluster")
    async def cluster() -> dict:
        return scheduler.describe()

    @app.middleware("http")
    async def health_when_down(request: Request, call_next):
        if request.url.path == "/health" and scheduler.down is not None:
            return unavailable(scheduler.down)
        return await call_next(request)
