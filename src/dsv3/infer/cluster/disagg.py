"""Prefill/decode disaggregation (``--prefill-ranks P``): the first P ranks prefill, the others decode, each
side expert-parallel over its own ranks (its own lockstep rounds).

A prefill rank prefills the requests it is given, emits each one's first token, and keeps the request
(its row state and its latent cache) until the front end names a decode rank for it. Then the request
moves over torch.distributed point to point: the row state (sampling stream, text state, MTP draft) as
pickled bytes, and of the latent cache only what decoding reads, c_kv and k_pe of the request's own slots
for every main layer (and the MTP layer when speculating), as raw bytes in the cache's dtype. The decode
rank rebuilds the row over a one-row batch holding that cache and merges it into its running batch, so
its decode continues exactly where one process would have: nothing is recomputed.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv3.infer.cluster.rank import Control, RankWorker, Ready, Report, Transfer, WireRequest
from dsv3.infer.engine import Batch, Engine, Event, Row, Stats


@dataclass
class RowState:
    """What decoding needs of a prefilled row besides its cache (small; pickled onto the wire)."""

    request: WireRequest
    generated: list[int]
    last: int
    next_pos: int
    draft: int | None
    draft_q: torch.Tensor | None
    rng: torch.Tensor  # the request's sampling generator state (a seeded request goes on as in one process)
    stream: tuple  # TextStream.state()

    @classmethod
    def of(cls, wire: WireRequest, row: Row) -> RowState:
        return cls(wire, list(row.generated), row.last, row.next_pos, row.draft, row.draft_q, row.gen.get_state(),
                   row.stream.state())

    def row(self, engine: Engine, request) -> Row:
        row = Row(request, engine.tokenizer, engine.eos_ids, engine.model.config.vocab_size)
        row.resume(self.generated)
        row.last, row.next_pos = self.last, self.next_pos
        row.draft, row.draft_q = self.draft, self.draft_q
        row.gen.set_state(self.rng)
        row.stream.restore(self.stream)
        return row


@dataclass
class Parcel:
    """A prefilled request ready to move: its state as bytes and its cache [layers, slots, width]."""

    state: torch.Tensor  # uint8
    kv: torch.Tensor
    pe: torch.Tensor


def cache_layers(engine: Engine) -> int:
    """Cache layers decoding reads: the main layers, plus the MTP layer when speculating."""
    cfg = engine.model.config
    return cfg.num_hidden_layers + (1 if engine.speculative else 0)


def cache_bytes_per_token(engine: Engine) -> int:
    """The latent cache's own bytes per token over the layers decoding reads (what a move must cost)."""
    cfg = engine.model.config
    size = torch.empty(0, dtype=engine.cache_dtype).element_size()
    return cache_layers(engine) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """Any dtype as uint8 [..., width * itemsize]: gloo moves bytes whatever the cache dtype (fp8 too)."""
    return x.contiguous().view(torch.uint8)


def move(transfers: list[Transfer], outbox: dict[int, Parcel], engine: Engine) -> list[tuple[Transfer, Parcel]]:
    """Run this rank's part of the step's moves: send the parcels it holds, receive the ones it gets (all
    posted at once, in the list's order on both sides, then awaited). Returns what arrived."""
    me, cfg = dist.get_rank(), engine.model.config
    layers, dtype = cache_layers(engine), engine.cache_dtype
    size = torch.empty(0, dtype=dtype).element_size()
    works, arrived = [], []
    for t in transfers:
        if t.src == me:
            parcel = outbox.pop(t.rid)
            works += [dist.isend(x, t.dst) for x in (parcel.state, _as_bytes(parcel.kv), _as_bytes(parcel.pe))]
        elif t.dst == me:
            state = torch.empty(t.state_bytes, dtype=torch.uint8)
            kv = torch.empty(layers, t.slots, cfg.kv_lora_rank * size, dtype=torch.uint8)
            pe = torch.empty(layers, t.slots, cfg.qk_rope_head_dim * size, dtype=torch.uint8)
            works += [dist.irecv(x, t.src) for x in (state, kv, pe)]
            arrived.append((t, Parcel(state, kv, pe)))
    for w in works:
        w.wait()
    return [(t, Parcel(p.state, p.kv.view(dtype), p.pe.view(dtype))) for t, p in arrived]


def pack_row(engine: Engine, batch: Batch, b: int, state: RowState) -> Parcel:
    """Row ``b`` of a prefilled batch as a parcel: its state, and c_kv and k_pe of its own (valid) slots
    only, in slot order, for the layers decoding reads."""
    layers = cache_layers(engine)
    slots = batch.valid[b, : batch.cur].to(batch.cache.kv.device)  # padding and holes are not the row's
    kv, pe = batch.cache.read_row(b, 0, batch.cur)
    raw = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    return Parcel(raw, kv[:layers, slots], pe[:layers, slots])


def unpack_state(parcel: Parcel) -> RowState:
    return pickle.loads(parcel.state.numpy().tobytes())


def batch_from_cache(engine: Engine, row: Row, kv: torch.Tensor, pe: torch.Tensor) -> Batch:
    """A one-row batch whose cache holds ``kv``/``pe`` [layers, slots, width] at slots [0, slots), all valid,
    in pages of the engine's pool; the state a one-row prefill leaves behind (see engine.Batch's cache layout)."""
    batch = Batch.__new__(Batch)  # not Batch(): that would prefill
    batch.engine, batch.model, batch.device = engine, engine.model, engine.device
    batch.stats, batch.T, batch.rows, batch.first_events = Stats(), 2 if engine.speculative else 1, [row], []
    batch.resumed = False
    n = kv.shape[1]
    batch.cur = 0
    batch._alloc([0])
    batch._reserve(n + batch.T)
    batch.cache.write_row(0, 0, kv, pe)
    batch.valid[:, :n] = True
    batch.cur = n
    batch.holes = False
    return batch


class PrefillWorker(RankWorker):
    """A prefill rank: prefills its new requests, emits their first tokens, and holds each live one as a
    parcel until the front end moves it to a decode rank."""

    def __init__(self, engine: Engine, lockstep, rank: int):
        super().__init__(engine, lockstep, rank)
        self.outbox: dict[int, Parcel] = {}
        self.wires: dict[int, WireRequest] = {}

    def step(self, control: Control) -> Report:
        events = self._drop_cancelled(control.cancel)
        move(control.transfers, self.outbox, self.engine)
        self._rebalance(control)
        for t in control.transfers:
            self._forget(t.rid)
        new = control.new.get(self.rank, [])
        self.wires.update({w.rid: w for w in new})
        events += self._admit([self._register(w) for w in new])
        ready = self._pack()
        self.lockstep.finish()
        return Report(self._wire(events), ready)

    def _drop_cancelled(self, rids: list[int]) -> list[Event]:
        self._cancel(rids)
        events = []
        for rid in [r for r in rids if r in self.outbox]:
            del self.outbox[rid]
            events.append(Event(self.requests[rid], [], "", "cancelled"))
        return events

    def _pack(self) -> list[Ready]:
        """The rows just prefilled, out of the batch and into parcels (c_kv and k_pe of their own slots)."""
        batch, self.batch = self.batch, None
        if batch is None:
            return []
        ready = []
        for b, row in enumerate(batch.rows):
            rid = self.rids[id(row.request)]
            parcel = self.outbox[rid] = pack_row(self.engine, batch, b, RowState.of(self.wires[rid], row))
            ready.append(Ready(rid, self.rank, parcel.kv.shape[1], parcel.state.numel()))
        return ready

    def _forget(self, rid: int) -> None:
        request = self.requests.pop(rid, None)
        self.wires.pop(rid, None)
        if request is not None:
            self.rids.pop(id(request), None)


class DecodeWorker(RankWorker):
    """A decode rank: takes in the parcels moved to it and decodes them with its running batch."""

    def step(self, control: Control) -> Report:
        arrived = move(control.transfers, {}, self.engine)
        self._rebalance(control)
        self._cancel(control.cancel)
        report = Report()
        events = []
        for t, parcel in arrived:
            report.kv_bytes += parcel.kv.nbytes + parcel.pe.nbytes
            report.kv_tokens += t.slots
            events += self._take_in(t, parcel)
        events += self._decode()
        self.lockstep.finish()
        report.events = self._wire(events)
        return self._report(report)

    def _take_in(self, t: Transfer, parcel: Parcel) -> list[Event]:
        state = unpack_state(parcel)
        request = self._register(state.request)
        if id(request) in self.unusable:
            return [self._unusable(request)]
        try:
            fresh = batch_from_cache(self.engine, state.row(self.engine, request), parcel.kv, parcel.pe)
        except Exception as exc:
            return [Event(request, [], "", "error", error=f"cannot take over this request: {exc}")]
        return self._join(fresh)
