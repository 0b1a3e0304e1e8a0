"""SIGTERM and the first Ctrl-C ask the run to stop after the current step (it then checkpoints and
exits 0); a second Ctrl-C interrupts at once."""

from __future__ import annotations

import signal
import threading


class GracefulStop:
    def __init__(self):
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
