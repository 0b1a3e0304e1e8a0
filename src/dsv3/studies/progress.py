"""Progress of a study that trains several models (``study fp8 --train``, ``study logfmt --train``):
minutes to hours with nothing to watch otherwise.

On a terminal: one rich bar on stderr over every step of every run, with the run being trained, its
loss and the time left. Elsewhere (a log file, a pipe): one line as each run starts. Stdout is never
touched, so ``--json`` still prints one JSON object and nothing else there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunsProgress:
    def __init__(self, title: str, runs: int, steps_per_run: int, console: Console | None = None):
        self.title, self.runs, self.steps = title, runs, steps_per_run
        self.console = console or Console(stderr=True)
        self._bar: Progress | None = None
        self._task = None
        self._started = 0

    def __enter__(self) -> RunsProgress:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console,
            )
            self._task = self._bar.add_task(self.title, total=self.runs * self.steps, loss="")
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def start_run(self, label: str) -> Callable[[dict[str, Any]], None]:
        """Announce the next run; returns the ``on_step`` callback for ``run_training``."""
        self._started += 1
        done_before = (self._started - 1) * self.steps
        text = f"{self.title}: run {self._started}/{self.runs} ({label})"
        if self._bar is None:
            self.console.print(text, highlight=False, soft_wrap=True)  # not a terminal: one line per run
        else:
            self._bar.update(self._task, description=text, completed=done_before)

        def on_step(row: dict[str, Any]) -> None:
            if self._bar is not None:
                loss = row.get("loss")
                self._bar.update(self._task, completed=done_before + min(row["step"], self.steps),
                                 loss="" if loss is None else f"loss {loss:.3f}")

        return on_step

    def note(self, message: str) -> None:
        """A line above the bar (a finished run's result)."""
        self.console.print(message, style="dim", highlight=False, soft_wrap=True)


def finished(summary: dict[str, Any], what: str) -> dict[str, Any]:
    """A study's training run's summary, once it ran to the end; a run stopped by a signal (Ctrl-C,
    SIGTERM) or left without a held-out loss ends the study with one clear error instead of a table
    that would compare a partial run with whole ones."""
    from dsv3.errors import DSV3Error

    if summary.get("stopped") == "signal":
        raise DSV3Error(f"the {what} run was stopped at step {summary['step']}; the study ends without results")
    if summary.get("val_loss") is None:
        raise DSV3Error(f"the {what} run ended ({summary.get('stopped')}) at step {summary['step']} without a "
                        "held-out loss; the study ends without results")
    return summary
