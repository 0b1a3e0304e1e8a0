"""Continuous batching for the server: one worker thread owns the engine and the running batch.

New requests are prefilled as their own batch and merged into the running one at a step boundary, so a
request never waits for others to finish; a cancelled request (its client went away) is dropped from
the batch at the next step, which frees its share of the compute and of the cache. Every request's
timing and every step's batch size go to ``metrics`` (``GET /metrics``).

With ``engine.max_prefill_tokens`` set, at most that many prompt tokens are prefilled whole between two
decode steps: admitted requests wait their turn in ``prefilling``, short prompts are prefilled together
while their lengths fit the budget, and a longer prompt a chunk at a time (``dsv3.infer.chunked_prefill``): the
streams that are decoding are slowed by a chunk at a time, not stalled by the whole prefill. On the CPU
decode step a chunk rides along the running batch's next step, its tokens extra rows of that forward (the
weights are read once for both), as many as keep the step near ``STREAM_SLOWDOWN`` times the streams' step
before the prompt arrived; elsewhere (MTP speculation, another device) a chunk runs between two steps and
takes about a step's time. With ``engine.prefill_threads`` set, such a prompt is instead prefilled on CPU
threads of its own while the steps go on (``dsv3.infer.prefill_beside``), one prompt at a time; another
arriving meanwhile is chunked.

Where the kernels' threads leave a CPU free, a step's events reach the HTTP thread just before the decode
thread next goes into C (the next step's kernel call, a prefill) or waits for requests (``_hand_over``):
the kernels let go of the GIL, so the HTTP thread's Python for those events runs while they compute, not
while the decode thread's own Python between two steps waits for the GIL. Where they fill every CPU, the
events are handed over right after the step (``_spare_core`` says why).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dsv3.infer.chunked_prefill import MAX_CHUNK_TOKENS, ChunkedPrefill
from dsv3.infer.engine import Batch, Engine, Event, Request, Rider, Row, merged
from dsv3.infer.metrics import ServingMetrics
from dsv3.infer.page_pool import PoolFull
from dsv3.infer.prefill_beside import Cores, PrefillBeside, pin, usable_cpus

Deliver = Callable[[Event | BaseException], None]  # called from the decode thread with each event of a request


@dataclass(frozen=True, eq=False)
class ToLoop:
    """A request's ``Deliver`` for the HTTP side: its events go to an asyncio queue read on ``loop``."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue

    def __call__(self, item: Event | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def deliver_all(items: Iterable[tuple[Deliver, Event | BaseException]]) -> None:
    """A step's events handed over with one wake-up of each event loop, not one per event: a wake-up is a
    thread switch (on asyncio's own loop also a self-pipe write that lets go of the GIL, uvloop's keeps it),
    and with every core running the step's kernels each one delays the decode thread (7% of it at 8 streams
    on 2 cores, measured with py-spy, before uvloop). Any other ``Deliver`` is called with its event."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event | BaseException]]] = {}
    for deliver, item in items:
        if isinstance(deliver, ToLoop):
            by_loop.setdefault(deliver.loop, []).append((deliver.events, item))
        else:
            deliver(item)
    for loop, pairs in by_loop.items():
        loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs: list[tuple[asyncio.Queue, Event | BaseException]]) -> None:
    for events, item in pairs:
        events.put_nowait(item)


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 8, metrics: ServingMetrics | None = None):
        self.engine, self.max_batch = engine, max_batch
        self.pending: queue.Queue[tuple[Request, Deliver] | None] = queue.Queue()  # None: only a wake-up
        self.listeners: dict[int, Deliver] = {}
        self.batch: Batch | None = None
        self.prefilling: deque[Request | ChunkedPrefill] = deque()  # admitted, prefill not finished (in order)
        self.resuming: deque[Row] = deque()  # preempted for want of cache pages (``Batch.step``), to prefill again
        self.beside: PrefillBeside | None = None  # a prompt being prefilled on threads of its own
        self.cores: Cores | None = None  # with engine.prefill_threads: the decode's and the prefill's CPUs
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.driven = False  # True: the caller's thread runs the decode loop (``drive``), start makes none
        self.metrics = metrics or ServingMetrics()
        self.metrics.running = lambda: self.active
        self.metrics.waiting = lambda: self.pending.qsize() + len(self.prefilling) + (self.beside is not None)
        self.metrics.prefix_cache = engine.prefix_cache
        self._stepped: tuple[Batch | None, float, int] = (None, 0.0, 0)  # (batch, decode_s, steps) at the last chunk
        self._step_s: float | None = None  # the running batch's recent decode step time
        self._riding: tuple[ChunkedPrefill, Rider] | None = None  # a chunk for the next step to carry
        self._outbox: list[tuple[Deliver, Event]] = []  # events sent, not handed over yet (``_hand_over``)
        self._during_kernels = False  # hand events over just before the next kernel call (``_spare_core``)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the decode worker on a thread of its own, unless ``drive`` runs it on the caller's."""
        if not self.driven:
            self._thread = threading.Thread(target=self._run, name="dsv3-decode", daemon=True)
            self._thread.start()

    def drive(self, until: Callable[[], bool]) -> None:
        """Run the decode loop on the calling thread until ``stop`` or ``until()``; ``dsv3 serve`` runs it on
        the process's main thread, with the HTTP server on another. The C kernels' OpenMP threads spin at
        their barriers only while libgomp manages no more threads than there are CPUs, and a team started
        from any thread but the main one counts one thread more: on 2 cores at 2 threads the engine's step
        took 3.6 ms on another thread against 1.1 ms on the main one (every barrier a sleep and a wake-up;
        ``benchmarks/batch_join.py``). The caller sets ``driven`` before the app starts, so that ``start`` makes no
        thread of its own."""
        self._run(until)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def active(self) -> int:
        """Requests being decoded now."""
        batch = self.batch
        return len(batch.rows) if batch is not None else 0

    # ---- submission (called from the event loop) ----------------------------------------------
    def submit(self, request: Request, events: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request; its events arrive on ``events`` (a new asyncio queue when None), which is returned
        (an exception on failure). Several requests may share one queue: an event names its request."""
        deliver = ToLoop(asyncio.get_running_loop(), asyncio.Queue() if events is None else events)
        self.metrics.arrived(request)
        self.pending.put((request, deliver))
        return deliver.events

    # ---- the worker ----------------------------------------------------------------------------
    def _run(self, until: Callable[[], bool] = lambda: False) -> None:
        self._during_kernels = self._spare_core()
        if self.engine.prefill_threads:
            # reading the count sets this thread's own from the process's (PyTorch does so at a thread's first
            # call), which the prefill's torch.set_num_threads changes for threads that have not read it yet
            self.cores = Cores.split(self.engine.prefill_threads, torch.get_num_threads())
            if self.cores is not None:
                pin(self.cores.decode)
        while not self._stop.is_set() and not until():
            self._admit()
            if self.batch is None:
                continue
            riding, self._riding = self._riding, None
            try:
                self.metrics.step(len(self.batch.rows))
                stats = self.batch.stats
                drafted, accepted = stats.drafted, stats.accepted
                before = stats.decode_s
                events = self.batch.step(riding[1] if riding else None,
                                         before_forward=self._hand_over if self._during_kernels else None)
                if riding is not None:
                    self._rode(*riding, stats.decode_s - before)
                preempted = self.batch.take_preempted()  # before the batch may go: they wait for pages
                self.resuming += preempted
                self.metrics.preempted(len(preempted))
                self.metrics.speculated(stats.drafted - drafted, stats.accepted - accepted)
                self._send(events)
            except Exception as exc:  # a failing step must not kill the server: fail its requests
                failed = [r.request for r in self.batch.rows + self.batch.take_preempted()]
                if riding is not None and riding[0] in self.prefilling:  # the prompt that rode along too
                    self.prefilling.remove(riding[0])
                    riding[0].release()
                    failed.append(riding[0].request)
                self._fail(failed, exc)
                self.batch.release()
                self.batch = None
                continue
            if not self.batch.rows:
                self.batch = None
        self._hand_over()

    def _spare_core(self) -> bool:
        """Whether this process has a CPU that neither the decode kernels' threads nor a prefill beside them
        use: there the HTTP thread runs beside the kernels, so a step's events are handed over just before
        the next step's kernel call. Without one, the HTTP thread would take a core from a kernel thread in
        the middle of a step, and every other kernel thread would wait for it at the next barrier: the events
        are handed over right after the step instead."""
        return usable_cpus() > torch.get_num_threads() + (self.engine.prefill_threads or 0)

    def _admit(self) -> None:
        """Take queued requests while the batch has room, then run the next share of prefill work."""
        room = self.max_batch - self.active - len(self.prefilling) - (self.beside is not None)
        new: list[tuple[Request, Deliver] | None] = []
        try:
            if self.batch is None and not self.prefilling:
                self._hand_over()
                new.append(self.pending.get(timeout=0.05))
            while len(new) < room:
                new.append(self.pending.get_nowait())
        except queue.Empty:
            pass
        for r, d in filter(None, new):
            if r.cancelled:
                self.metrics.finished(r, "cancelled")
                continue
            self.listeners[id(r)] = d
            self.prefilling.append(r)
        self._prefill_next()

    def _prefill_next(self) -> None:
        """Prefill work up to the budget (``engine.max_prefill_tokens`` while a batch decodes; all of it when
        None or when nothing decodes): rows preempted for want of cache pages first, then one chunk of a long
        prompt, or the next prompts whose lengths fit together; each finished batch joins."""
        self._drop_cancelled()
        self._collect_beside()
        if self.resuming or self.prefilling:
            self._hand_over()  # a prefill runs in C too
        if self.resuming:
            self._resume()
            return
        if not self.prefilling:
            return
        # a budget only while streams decode: chunks exist to let them go on, and with none running a whole
        # prefill reaches the first token sooner (each chunk is a forward with its own fixed cost)
        budget = self.engine.max_prefill_tokens if self.batch is not None else None
        if isinstance(self.prefilling[0], ChunkedPrefill):
            self._advance(self.prefilling[0])
            return
        take = self._fitting(budget)
        if not take:  # the next prompt alone is over the budget: chunk it
            request = self.prefilling[0]
            try:
                self.prefilling[0] = ChunkedPrefill(self.engine, request, min(budget, MAX_CHUNK_TOKENS))
            except PoolFull:
                return  # a batch runs (budget is set only then): it gives pages back as its rows finish
            except Exception as exc:
                self.prefilling.popleft()
                self._fail([request], exc)
                return
            self.metrics.admitted(request)
            if not self._start_beside():
                self._advance(self.prefilling[0])
            return
        for fresh in self._prefill(take):
            self._join(fresh)

    def _start_beside(self) -> bool:
        """Hand the prompt chunked at the head of ``prefilling`` to a prefill of its own beside the decode
        steps, when the engine gives threads to one and none runs; False leaves it to ride them (so does a
        pool that lacks its pages now: its chunks take them as they go)."""
        if not self.engine.prefill_threads or self.beside is not None or self.prefilling[0].remaining < 2:
            return False
        try:
            cpus = self.cores.prefill if self.cores is not None else None
            self.beside = PrefillBeside(self.prefilling[0], self.engine.prefill_threads, cpus,
                                        lambda: self.pending.put(None))
        except PoolFull:
            return False
        self.prefilling.popleft()
        return True

    def _collect_beside(self) -> None:
        """A prefill beside the steps that has ended: its prompt goes back to the head of ``prefilling``, where
        its last slot is prefilled by the batch it joins (``_advance``); a cancelled or failed one gives its
        pages back."""
        job = self.beside
        if job is None or not job.finished.is_set():
            return
        self.beside, work = None, job.work
        if work.request.cancelled:
            work.release()
            self._cancelled(work.request)
        elif job.error is not None:
            work.release()
            self._fail([work.request], job.error)
        else:
            self.prefilling.appendleft(work)

    def _resume(self) -> None:
        """Prefill the preempted rows again, as many as the pool has pages for, oldest first."""
        for row, fresh in self.engine.resume_waiting(self.resuming, lambda: bool(self.active)):
            if isinstance(fresh, Exception):
                self._fail([row.request], fresh)
            else:
                self._join(fresh)

    def _fitting(self, budget: int | None) -> list[Request]:
        """The waiting requests at the head of ``prefilling`` whose prompts fit ``budget`` tokens together
        (all of them when None), taken off it."""
        take, tokens = [], 0
        while self.prefilling and isinstance(self.prefilling[0], Request):
            tokens += len(self.prefilling[0].prompt_ids)
            if budget is not None and tokens > budget:
                break
            take.append(self.prefilling.popleft())
        return take

    def _advance(self, work: ChunkedPrefill) -> None:
        """The next chunk of the prompt at the head of ``prefilling``; its batch joins after the last. While a
        batch decodes that can carry it, every chunk but the last rides along its next step (``Rider``, sized
        by its ``RiderPace``); otherwise a chunk runs between two steps, sized to take about one step's time.
        The first chunk holds a token per row (and token) of the step."""
        batch = self.batch
        seconds = self._recent_step_s() if batch is not None else None
        try:
            if batch is not None and batch.carries_riders:
                if seconds is None:  # the batch's first step goes alone: its time sets the riders' pace
                    return
                rider = work.rider(work.rider_tokens(seconds, len(batch.rows)))
                if rider is not None:
                    self._riding = (work, rider)
                    return
            fresh = work.advance(seconds, first=len(batch.rows) * batch.T if batch is not None else 1)
        except PoolFull:
            if batch is not None:  # the running rows give pages back as they finish: wait for them
                return
            self.prefilling.popleft()
            work.release()
            self._fail([work.request], PoolFull.alone(len(work.request.prompt_ids)))
            return
        except Exception as exc:  # this request fails alone
            self.prefilling.popleft()
            work.release()
            self._fail([work.request], exc)
            return
        if fresh is not None:
            self.prefilling.popleft()
            self._join(fresh)

    def _rode(self, work: ChunkedPrefill, rider: Rider, step_s: float) -> None:
        """After a step that carried ``rider`` (in ``step_s``): its tokens count as prefilled; the step is left
        out of the plain steps' measure (``_recent_step_s``)."""
        if not rider.ridden:  # every row left before the forward: the chunk waits for the next turn
            return
        work.rode(rider, step_s)
        batch = self.batch
        self._stepped = (batch, batch.stats.decode_s, batch.stats.main_forwards)

    def _recent_step_s(self) -> float | None:
        """The running batch's mean decode step time since the last chunk (the last known one when it has not
        stepped since; None before any step)."""
        batch = self.batch
        stats = batch.stats
        last, decode_s, steps = self._stepped
        if last is not batch:
            decode_s, steps = 0.0, 0
        if stats.main_forwards > steps:
            self._step_s = (stats.decode_s - decode_s) / (stats.main_forwards - steps)
        self._stepped = (batch, stats.decode_s, stats.main_forwards)
        return self._step_s

    def _drop_cancelled(self) -> None:
        """Requests whose clients went away while they waited for (or were in) their prefill, or for pages
        to resume."""
        for work in [w for w in self.prefilling if _request_of(w).cancelled]:
            self.prefilling.remove(work)
            if isinstance(work, ChunkedPrefill):
                work.release()
            self._cancelled(_request_of(work))
        for row in [r for r in self.resuming if r.request.cancelled]:
            self.resuming.remove(row)
            self._cancelled(row.request)

    def _cancelled(self, request: Request) -> None:
        self.listeners.pop(id(request), None)
        self.metrics.finished(request, "cancelled")

    def _prefill(self, requests: list[Request], others: bool = False) -> list[Batch]:
        """The new requests prefilled together; when that fails, each alone, so that a request that
        breaks the prefill fails by itself (per-row failures are already the row's own error event). When
        the cache has no pages for a request, it and those after it wait at the head of ``prefilling`` while
        rows run that will give some back (the running batch's, or ``others``: batches prefilled just before
        it that have not joined yet); with none running, it can never fit and fails."""
        try:
            batch = self.engine.start(requests)
        except PoolFull:
            if len(requests) > 1:
                return self._prefill_each(requests)
            if others or (self.batch is not None and self.batch.rows):
                self.prefilling.appendleft(requests[0])
                return []
            self.metrics.admitted(requests[0])
            self._fail(requests, PoolFull.alone(len(requests[0].prompt_ids)))
            return []
        except Exception as exc:
            if len(requests) > 1:
                return self._prefill_each(requests)
            self.metrics.admitted(requests[0])
            self._fail(requests, exc)
            return []
        for r in requests:
            self.metrics.admitted(r)
        return [batch]

    def _prefill_each(self, requests: list[Request]) -> list[Batch]:
        batches = []
        for i, r in enumerate(requests):
            batches += self._prefill([r], others=bool(batches))
            if self.prefilling and self.prefilling[0] is r:  # it waits for pages: so do the ones after it
                self.prefilling.popleft()
                self.prefilling.extendleft(reversed(requests[i:]))
                break
        return batches

    def _join(self, fresh: Batch) -> None:
        """Merge a prefilled batch into the running one at this step boundary."""
        try:
            self.batch = merged(self.batch, fresh)
        except Exception as exc:  # the running batch is left as it was: only the newcomers fail
            self._send([ev for ev in fresh.first_events if ev.finish_reason])
            self._fail([r.request for r in fresh.rows], exc)
            fresh.release()
            return
        self._send(fresh.first_events)

    def _send(self, events: list[Event]) -> None:
        """Count the events and queue them for their requests' listeners, handed over now, or with
        ``_during_kernels`` just before the next kernel call (``_hand_over``)."""
        for ev in events:
            self.metrics.event(ev.request, len(ev.token_ids), ev.finish_reason)
            deliver = self.listeners.get(id(ev.request))
            if deliver is not None:
                self._outbox.append((deliver, ev))
            if ev.finish_reason:
                self.listeners.pop(id(ev.request), None)
        if not self._during_kernels:
            self._hand_over()

    def _hand_over(self) -> None:
        """Deliver the events sent since the last hand-over. Called just before the decode thread goes into C
        (the next step's kernel call, a prefill) or waits for requests, and when its loop ends: the HTTP
        thread, woken here, then runs its Python for them while the kernels hold no GIL. Woken right after a
        step, it took the GIL from the decode thread's Python between two steps."""
        if self._outbox:
            out, self._outbox = self._outbox, []
            deliver_all(out)

    def _fail(self, requests: list[Request], exc: BaseException) -> None:
        self._hand_over()  # their earlier events first
        for r in requests:
            self.metrics.finished(r, "error")
            deliver = self.listeners.pop(id(r), None)
            if deliver is not None:
                deliver(exc)


def _request_of(work: Request | ChunkedPrefill) -> Request:
    return work.request if isinstance(work, ChunkedPrefill) else work
