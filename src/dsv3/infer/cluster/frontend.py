"""Rank 0 of a serving group: the scheduler behind the HTTP server, spreading requests over the ranks.

``ClusterScheduler`` replaces the single-process ``Scheduler`` under the same HTTP app: requests are
queued the same way, but its worker thread drives the whole group. Each step it assigns waiting requests
to the least loaded ranks (at most ``max_batch`` each), broadcasts one ``Control`` message (gloo, small),
runs rank 0's own share of the step, gathers every rank's events and delivers them to the HTTP side.

When any collective fails (a rank died, or one did not answer within the group's timeout) the group is
down for good: every request in flight and every later one fails with ``ClusterDown``, which the app
answers with HTTP 503 and an OpenAI-shaped JSON error, at once rather than hanging.
"""

from __future__ import annotations

import asyncio
import queue
import time

import torch.distributed as dist

from dsv3.errors import DSV3Error
from dsv3.infer.cluster.affinity import PrefixAffinity
from dsv3.infer.cluster.rank import Control, RankWorker, Ready, Report, Transfer, WireEvent, WireRequest
from dsv3.infer.engine import Engine, Request
from dsv3.infer.prefix_cache import CacheSnapshot
from dsv3.infer.scheduler import Deliver, Scheduler, deliver_all

IDLE_WAIT_S = 0.05  # how long an idle group waits for a request before stepping anyway
LOAD_REFRESH_S = 1.0  # while busy, the ranks' expert load (/metrics) is gathered at most this often


class ClusterDown(Exception):
    """The serving group lost a rank: nothing can be generated any more (HTTP 503)."""


def broadcast_control(control: Control | None) -> Control:
    """Rank 0's control message to every rank (``control`` is ignored elsewhere)."""
    box = [control]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_reports(report: Report) -> list[Report] | None:
    """Every rank's report at rank 0, in rank order (None elsewhere)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(report, out, dst=0)
    return out


def worker_loop(worker: RankWorker) -> None:
    """A rank other than 0: follow rank 0's control messages until it says stop."""
    while True:
        control = broadcast_control(None)
        if control.stop:
            return
        gather_reports(step(worker, control))


def step(worker: RankWorker, control: Control) -> Report:
    """One step of this rank's worker; its routed-token counts join the report when rank 0 asked for them
    (not every step: they are layers x experts integers)."""
    report = worker.step(control)
    if control.report_load:
        report.expert_load = worker.lockstep.routed_counts()
        cache = worker.engine.prefix_cache
        report.prefix_cache = cache.snapshot() if cache is not None else None
    return report


class ClusterScheduler(Scheduler):
    """The single-process scheduler's interface (``submit``, ``start``, ``stop``, ``active``, ``pending``)
    over a group of ``world`` ranks, rank 0's ``worker`` among them. New requests go to the least loaded of
    ``prefill`` ranks (default: all); with ``decode`` ranks given (disaggregation), each prefilled request's
    latent cache then moves to the least loaded decode rank with room. ``max_batch`` bounds each rank."""

    def __init__(self, engine: Engine, worker: RankWorker, world: int, max_batch: int = 8,
                 prefill: list[int] | None = None, decode: list[int] | None = None, eplb_every: int = 0):
        super().__init__(engine, max_batch)
        self.worker, self.world = worker, world
        self.prefill = prefill if prefill is not None else list(range(world))  # ranks that take new requests
        self.decode = decode or []  # ranks that take prefilled requests (disaggregation)
        self.waiting: list[tuple[Request, Deliver]] = []  # queued, not yet given to a rank
        self.ready: list[Ready] = []  # prefilled, not yet moved to a decode rank
        self.inflight: dict[int, tuple[Request, int]] = {}  # rid -> (request, rank holding it)
        self.load = [0] * world  # requests in flight per rank
        self.assigned = [0] * world  # requests given to each rank so far (prefilled or moved there)
        self.kv_bytes = self.kv_tokens = 0  # latent cache moved from prefill to decode ranks
        self.down: str | None = None
        self.steps = 0
        self.eplb_every, self.busy_steps = eplb_every, 0  # rebalance every eplb_every steps with work
        self._next_rid = 0
        lockstep = getattr(worker, "lockstep", None)  # every rank has the same MoE layers: zeros until reported
        zeros = [[0] * len(c) for c in lockstep.routed_counts()] if lockstep is not None else None
        self.expert_counts = {r: zeros for r in range(world)} if zeros else {}  # rank -> [MoE layer][expert]
        self._load_asked, self._load_stale, self._load_at = False, False, 0.0
        self.metrics.expert_load = self.expert_load
        self.metrics.waiting = lambda: self.pending.qsize() + len(self.waiting)  # taken in, no rank had room
        self._prefix_setup(engine)

    def _prefix_setup(self, engine: Engine) -> None:
        """With prefix caches on the prefill ranks (rank 0 is one: it has a cache when they do), route
        prompts by prefix (``affinity``) and show the caches' sum in /metrics, refreshed with the expert load."""
        cache = engine.prefix_cache
        self.affinity = PrefixAffinity(cache.block_tokens) if cache is not None else None
        self.cache_snapshots = {r: cache.snapshot() for r in self.prefill} if cache is not None else {}
        self.metrics.prefix_cache = self if cache is not None else None

    def snapshot(self) -> CacheSnapshot:
        """The prefill ranks' prefix caches summed, as last gathered (``ServingMetrics.prefix_cache``)."""
        self._load_asked = True
        return CacheSnapshot.total(list(self.cache_snapshots.values()))

    @property
    def active(self) -> int:
        return len(self.inflight)

    def submit(self, request: Request, events: asyncio.Queue | None = None) -> asyncio.Queue:
        if self.down is None:
            return super().submit(request, events)
        events = asyncio.Queue() if events is None else events  # answered at once: nothing can generate any more
        events.put_nowait(ClusterDown(self.down))
        return events

    # ---- the worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
            broadcast_control(Control(stop=True))
        except Exception as exc:  # a collective failed: the group is gone
            self._go_down(exc)

    def _step(self) -> None:
        cancel = self._cancelled()
        control = Control(new=self._assign(), cancel=cancel, transfers=self._transfers(set(cancel)),
                          rebalance=self._rebalance_now())
        control.report_load = self._load_due()
        if self.inflight:
            self.metrics.step(len(self.inflight))
        broadcast_control(control)
        for rank, report in enumerate(gather_reports(step(self.worker, control))):
            self.metrics.speculated(report.drafted, report.accepted)  # before its requests can end: a
            self._deliver(report.events)  # client that scrapes after its last token sees the step counted
            self.ready += report.ready
            self.kv_bytes += report.kv_bytes
            self.kv_tokens += report.kv_tokens
            if report.expert_load is not None:
                self.expert_counts[rank] = report.expert_load
            if report.prefix_cache is not None:
                self.cache_snapshots[rank] = report.prefix_cache
        self.steps += 1

    # ---- expert load (/metrics) --------------------------------------------------------------------
    def expert_load(self) -> dict[int, list[list[int]]]:
        """``ServingMetrics.expert_load``: every rank's routed-token counts as last gathered (at most about
        LOAD_REFRESH_S behind while busy; a scrape also asks for fresh ones at the next step). Called from
        the HTTP thread, so it never waits for the group."""
        self._load_asked = True
        return dict(self.expert_counts)

    def _load_due(self) -> bool:
        """Gather the counts this step: a scrape asked, or work ran since the last gather and it is old."""
        self._load_stale = self._load_stale or bool(self.inflight)
        now = time.monotonic()
        if not (self._load_asked or (self._load_stale and now - self._load_at >= LOAD_REFRESH_S)):
            return False
        self._load_asked, self._load_stale, self._load_at = False, bool(self.inflight), now
        return True

    def _rebalance_now(self) -> bool:
        if not self.inflight:
            return False
        self.busy_steps += 1
        return bool(self.eplb_every) and self.busy_steps % self.eplb_every == 0

    def _room(self, ranks: list[int]) -> int | None:
        """The least loaded of ``ranks`` when it has room for one more request, else None."""
        rank = min(ranks, key=lambda r: self.load[r])
        return rank if self.load[rank] < self.max_batch else None

    def _prefill_rank(self, request: Request) -> int | None:
        """The prefill rank for a new request: by prefix when the ranks cache prefixes, else the least loaded;
        None when no prefill rank has room."""
        if self.affinity is None:
            return self._room(self.prefill)
        ranks = [r for r in self.prefill if self.load[r] < self.max_batch]
        return self.affinity.choose(request.prompt_ids, ranks, self.load) if ranks else None

    def _assign(self) -> dict[int, list[WireRequest]]:
        """Waiting requests given to the least loaded ranks with room; the rest keep waiting."""
        self._take(block=not self.inflight and not self.waiting)
        new: dict[int, list[WireRequest]] = {}
        keep = []
        for request, deliver in self.waiting:
            if request.cancelled:
                self.metrics.finished(request, "cancelled")
                continue
            rank = self._prefill_rank(request)
            if rank is None:
                keep.append((request, deliver))
                continue
            rid, self._next_rid = self._next_rid, self._next_rid + 1
            self.metrics.admitted(request)  # its rank prefills it in this step
            self.listeners[rid] = deliver
            self.inflight[rid] = (request, rank)
            self._move(rid, None, rank)
            new.setdefault(rank, []).append(WireRequest.of(rid, request))
        self.waiting = keep
        return new

    def _transfers(self, cancelled: set[int]) -> list[Transfer]:
        """Prefilled requests moved to the least loaded decode ranks with room (cancelled ones stay: their
        prefill rank drops them); the rest wait on their prefill ranks."""
        moves, keep = [], []
        for ready in self.ready:
            if ready.rid not in self.inflight or ready.rid in cancelled:
                continue
            dst = self._room(self.decode)
            if dst is None:
                keep.append(ready)
                continue
            moves.append(Transfer(ready.rid, ready.rank, dst, ready.slots, ready.state_bytes))
            self.inflight[ready.rid] = (self.inflight[ready.rid][0], dst)
            self._move(ready.rid, ready.rank, dst)
        self.ready = keep
        return moves

    def _move(self, rid: int, src: int | None, dst: int) -> None:
        if src is not None:
            self.load[src] -= 1
        self.load[dst] += 1
        self.assigned[dst] += 1

    def _take(self, block: bool) -> None:
        try:
            if block:
                self.waiting.append(self.pending.get(timeout=IDLE_WAIT_S))
            while True:
                self.waiting.append(self.pending.get_nowait())
        except queue.Empty:
            pass

    def _cancelled(self) -> list[int]:
        return [rid for rid, (request, _) in self.inflight.items() if request.cancelled]

    def _deliver(self, events: list[WireEvent]) -> None:
        out = []
        for wire in events:
            request, rank = self.inflight.get(wire.rid, (None, 0))
            if request is None:
                continue
            if wire.cached_tokens:  # from the prefill rank (a decode rank's copy never prefilled)
                request.cached_tokens = wire.cached_tokens
            self.metrics.event(request, len(wire.token_ids), wire.finish_reason)
            deliver = self.listeners.get(wire.rid)
            if deliver is not None:
                out.append((deliver, wire.event(request)))
            if wire.finish_reason:
                self.listeners.pop(wire.rid, None)
                self.inflight.pop(wire.rid)
                self.load[rank] -= 1
        deliver_all(out)

    def describe(self) -> dict:
        """The group's state as JSON (GET /cluster)."""
        moved = self.kv_bytes / self.kv_tokens if self.kv_tokens else None
        return {"ranks": self.world, "prefill_ranks": self.prefill if self.decode else None,
                "decode_ranks": self.decode or None, "status": "down" if self.down else "ok", "error": self.down,
                "steps": self.steps, "in_flight": list(self.load), "assigned": list(self.assigned),
                "queued": len(self.waiting) + self.pending.qsize(), "kv_bytes_moved": self.kv_bytes,
                "kv_tokens_moved": self.kv_tokens, "kv_bytes_per_token_moved": moved,
                "eplb": self._eplb()}

    def _eplb(self) -> dict:
        """Rank 0's group: rebalances so far, and the max/mean rank load before and after the last one."""
        lockstep = self.worker.lockstep
        last = lockstep.imbalance
        return {"rebalances": lockstep.rebalances, "imbalance_before": last[0] if last else None,
                "imbalance_after": last[1] if last else None}

    # ---- failure --------------------------------------------------------------------------------
    def _go_down(self, exc: BaseException) -> None:
        """Fail everything in flight and everything that comes later with ClusterDown."""
        self.down = f"the serving group lost a rank and cannot generate: {_reason(exc)}"
        for rid, (request, _) in list(self.inflight.items()):
            self.metrics.finished(request, "error")
            deliver = self.listeners.pop(rid, None)
            if deliver is not None:
                deliver(ClusterDown(self.down))
        self.inflight.clear()
        while not self._stop.is_set():
            self._drain()
            time.sleep(IDLE_WAIT_S)

    def _drain(self) -> None:
        self._take(block=False)
        waiting, self.waiting = self.waiting, []
        for request, deliver in waiting:
            self.metrics.finished(request, "error")
            deliver(ClusterDown(self.down))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_group(world: int, ep: int) -> None:
    if world != ep:
        raise DSV3Error(f"--ep {ep} needs exactly {ep} processes, got {world}: run it under torchrun "
                        f"--nproc-per-node {ep}")
