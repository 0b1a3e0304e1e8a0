"""How many prompt tokens ride each decode step while a long prompt is prefilled in chunks (``Rider``).

The streams that are decoding get one token a step, so a step that carries a chunk is a longer wait for
each of them. The pace holds that step near ``STREAM_SLOWDOWN`` times the streams' plain step when the
prompt's first chunk rode (their time per token then): the streams' pace is what is held, and the
prompt's tokens fill what is left of it. It is a controller on the step's own measured time, not on a
model of it: a rider token's cost grows with the slots it attends to (the late tokens of a 4,000-token
prompt cost several times the early ones), and the streams' steps with their contexts.

Tried in ``benchmarks/chunked_prefill.py`` and dropped: a model of the step (plain step plus tokens times
a cost per token, both measured as it goes, the plain step by a step without a rider now and then) held
the target as well, but its riders were smaller: the 4,000-token prompt reached its first token in 8 to
24 s against about 7, and the streams' 99th percentile was no lower (2.7 to 3.7 times their median
before, against 3.2 to 3.6) on a busy 2-core host.
"""

from __future__ import annotations

STREAM_SLOWDOWN = 2.5  # the target step over the streams' plain step when the first chunk rode


class RiderPace:
    """The rider sizes of one prompt's chunked prefill, from the running batch's plain step when its first
    chunk rode (``reference_s``)."""

    def __init__(self, reference_s: float):
        self.target_s = STREAM_SLOWDOWN * reference_s
        self.last: tuple[int, float] | None = None  # (tokens, seconds of the step that carried them)

    def tokens(self, rows: int, most: int) -> int:
        """The next rider's tokens beside ``rows`` rows, from 1 to ``most``: one per row for the first; then
        the last rider's scaled by how far its step was from the target. At least a token per row: once the
        streams' own steps near the target (their contexts grow while the prompt is prefilled), a floor of
        one token let the prefill, and with it that growth, stretch to several times as long in some runs of
        ``benchmarks/chunked_prefill.py``."""
        if self.last is None:
            n = rows
        else:
            tokens, seconds = self.last
            n = round(tokens * self.target_s / max(seconds, 1e-6))
        return max(1, min(max(n, rows), most))

    def rode(self, tokens: int, seconds: float) -> None:
        """A step with a rider of ``tokens`` tokens took ``seconds``."""
        self.last = (tokens, seconds)
