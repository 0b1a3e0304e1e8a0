"""What the user watches on stderr: a live rich progress bar on a terminal (step, loss, tokens/s,
learning rate, ETA), or one plain log line every few steps when stderr is a file or a pipe."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    def __init__(self, total: int, log_every: int, enabled: bool = True):
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.console = Console(file=sys.stderr)
        self._progress = None

    def start(self, completed: int) -> None:
        """Show the bar (on a terminal) from step ``completed``."""
        if self.enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=self.total, completed=completed, stats="")
            self._progress.start()

    def step(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        stats = _stats(row)
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], stats=stats)
        elif row["step"] % self.log_every == 0 or row["step"] == self.total or row.get("skipped"):
            self.console.print(f"step {row['step']}/{self.total}  {stats}", highlight=False)

    def note(self, message: str) -> None:
        """One message: on a terminal wrapped at spaces to its width; into a file or a pipe one line,
        since rich would otherwise break it at an assumed 80 columns, which no reader (or grep) expects."""
        if self.enabled:
            self.console.print(message, highlight=False, soft_wrap=not self.console.is_terminal)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _stats(row: dict[str, Any]) -> str:
    loss = row.get("loss")
    loss_text = "skipped (non-finite)" if row.get("skipped") else f"loss {loss:.4f}"
    return f"{loss_text}  {row['tokens_per_s']:,.0f} tok/s  lr {row['lr']:.2e}"
