"""An ASGI app on a real uvicorn server in a thread, for the tests and benchmarks that talk to the OpenAI
API over real HTTP rather than through a test client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
