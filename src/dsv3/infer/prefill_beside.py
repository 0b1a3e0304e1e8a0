"""Prefill beside the decode steps: a long prompt prefilled on CPU threads of its own while the running batch
goes on decoding (``dsv3 serve --prefill-threads N``).

Chunks that ride the decode steps (``dsv3.infer.chunked_prefill``) share the decode's threads: every step
that carries one is a longer wait for each stream, and a pace that keeps the streams near a target makes the
prompt wait longer for its first token. Where the CPU has cores the decode steps do not use (``--threads``
below the core count), the prompt can be prefilled on those instead, at the same time as the steps: the
streams then share with it only what the cores share (memory bandwidth, the last-level cache, Python's
interpreter lock between kernels). On a 2-core host with the decode on one core, a 4,000-token prompt among
4 streams reached its first token in 2.7-2.9 s, against 2.0 s prefilled whole (the streams stalled) and
5-7 s riding the steps (``benchmarks/chunked_prefill.py``, docs/inference.md).

The prompt's slots [done, L - 1) are prefilled in one forward through the model's modules (the path a whole
prefill of a long prompt takes) on a thread of its own with N torch threads, into pages the scheduler's
thread reserved before it started: the pool and the decode step are only touched there. The last slot is
prefilled by the batch the request joins (``PrefilledBatch``, on the scheduler's thread), which samples the
first token, as a chunked prompt's last chunk is. The forward is one piece of work: a client that goes away
meanwhile is noticed when it ends (then its pages go back).

Where the OS allows, the prefill's thread runs only on CPU time no other thread wants (Linux's SCHED_IDLE):
the server's HTTP thread and its clients, which wake up for every token, then take the prefill's core
rather than the decode's. And where there are cores for both, they are split (``Cores``): the decode thread
keeps the first, the prefill the last N, so that neither moves onto the other's core.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv3.infer.chunked_prefill import ChunkedPrefill


@dataclass(frozen=True)
class Cores:
    """The CPUs the decode thread keeps and those a prefill beside it runs on."""

    decode: frozenset[int]
    prefill: frozenset[int]

    @staticmethod
    def split(prefill_threads: int, decode_threads: int) -> Cores | None:
        """The calling thread's allowed CPUs, the last ``prefill_threads`` for the prefill and the rest for the
        decode; None where the OS has no affinity calls or there are too few CPUs for both (pinned to fewer
        cores than it has threads, the decode would take turns on them)."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < prefill_threads + decode_threads:
            return None
        return Cores(frozenset(allowed[:-prefill_threads]), frozenset(allowed[-prefill_threads:]))


def usable_cpus() -> int:
    """How many CPUs this thread may run on (its affinity where the OS has one, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin(cpus: frozenset[int]) -> None:
    """Run the calling thread (and threads it starts from now on) on ``cpus`` only, where the OS allows."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):
        pass


def yield_to_others() -> None:
    """Run the calling thread only on CPU time no other thread wants (Linux's SCHED_IDLE), where it can."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


class PrefillBeside:
    """One prompt's prefill on a thread of its own (on ``cpus`` when given), started at construction
    (PoolFull, no thread started and nothing more taken, when the pool lacks the prompt's pages).
    ``finished`` is set when it ends, after which ``work`` holds every slot but the last, or ``error`` says
    why not; ``wake`` is called then too (the scheduler's loop may be waiting for requests)."""

    def __init__(self, work: ChunkedPrefill, threads: int, cpus: frozenset[int] | None,
                 wake: Callable[[], None]):
        self.work, self.threads, self.cpus, self._wake = work, threads, cpus, wake
        self.end = len(work.request.prompt_ids) - 1
        work.reserve(self.end)
        self.error: BaseException | None = None
        self.finished = threading.Event()
        threading.Thread(target=self._run, name="dsv3-prefill", daemon=True).start()

    def _run(self) -> None:
        try:
            yield_to_others()
            if self.cpus is not None:
                pin(self.cpus)
            torch.set_num_threads(self.threads)  # this thread's (threads that have read theirs keep it)
            self.work.prefill_through_modules(self.end)
        except BaseException as exc:  # the scheduler fails this request alone
            self.error = exc
        finally:
            self.finished.set()
            self._wake()
