"""An ASGI app on a real uvicorn server in a thread, for the tests and benchmarks that talk to the OpenAI
API over real HTTP rather than through a test client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv3.testing.launch import free_port


@contextmanager
def serving(app, start_timeout_s: float = 20.0) -> Iterator[str]:
    """``app`` on 127.0.0.1 at a free port, in a daemon thread; yields its base URL, stops it on exit."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=20)


@contextmanager
def serve_process(args: list[str], log: Path, start_timeout_s: float = 180.0) -> Iterator[str]:
    """``python -m dsv3 serve --port 0 ARGS`` in its own process, its stderr in ``log``; yields its base URL
    once it listens, and stops it (terminate, then kill) on exit."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dsv3", "serve", "--port", "0", *args],
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + start_timeout_s
        while not (found := re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None, f"serve exited: {log.read_text()}"
            assert time.time() < deadline, f"serve did not start within {start_timeout_s:.0f} s"
            time.sleep(0.1)
        yield found.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def serve_in_threads(monkeypatch) -> list[tuple[object, threading.Thread]]:
    """Make ``dsv3 serve`` called in-process (``dsv3.cli.main``) return once it listens: its uvicorn server
    runs on a thread and the decode loop on one of its own (started by the app, as under ``serving``)
    instead of on the caller's. Returns the list of (server, thread) each call adds, to stop them."""
    from dsv3.infer import cli

    servers: list[tuple[object, threading.Thread]] = []

    def run_in_a_thread(server, sock, scheduler) -> None:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))

    monkeypatch.setattr(cli, "run_beside", run_in_a_thread)
    return servers

