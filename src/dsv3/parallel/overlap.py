"""Dual micro-batch overlap: interleave the step generators of two (or more) micro-batches.

Each generator yields right after launching an async collective. Round-robin means that while micro-batch
A's dispatch or combine is in flight, micro-batch B runs its compute up to its own next launch, and vice
versa (the prefill overlap of DeepSeek's inference system, DualPipe's forward pairing). The order of
collectives is the same on every rank because the schedule never depends on the data.
"""

from __future__ import annotations

from collections.abc import Generator


def run_interleaved(steps: list[Generator]) -> list:
    """Advance each generator to its next yield in turn until all finish; return their values in order."""
    results: list = [None] * len(steps)
    active = list(range(len(steps)))
    while active:
        for i in list(active):
            try:
                next(steps[i])
            except StopIteration as done:
                results[i] = done.value
                active.remove(i)
    return results
