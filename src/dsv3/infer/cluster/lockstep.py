"""Lockstep expert parallelism for serving: every MoE forward of every rank becomes one *round*.

Attention is data-parallel in an EP serving group: each rank prefills and decodes its own requests, so at
any moment rank A may be in layer 3 of a decode step while rank B is in layer 1 of a prefill and rank C
has nothing to do. The experts of every layer are spread over all ranks, so every rank must join every
layer's exchange, with zero tokens when it has none. A round settles this without a central schedule:

1. each rank says which MoE layer it is about to run (its index), or DONE when its step's work is over,
   in one small ``all_gather``;
2. every rank then runs the exchange of each requested layer, in increasing index order: with its own
   tokens for the layer it asked for, with zero tokens for the others (its experts still compute the rows
   other ranks send them).

The number and order of collectives is therefore the same on every rank whatever each rank's work
(prefill or decode, MTP draft or none, a batch prefilled again row by row), and a step ends with the
first round in which every rank says DONE (``Lockstep.finish``). The exchange itself is the training
dispatcher's (``ExpertParallelDispatcher``): there is no second copy of the expert computation.

Dual micro-batch decode (``micro_batches`` 2, ``serve --micro-batches 2``): every exchange of a round is a
*pair*, two exchanges of the same layer whose steps are interleaved (each yields while its all-to-all is in
flight), so that one half of a decode batch computes while the other half's dispatch or combine travels.
A rank whose decode step is split into two halves (``run_pair``) runs its layer's pair from the two
halves' forwards: half 0 opens the round (one gather per pair), half 1 joins it. Any other forward (a
prefill, an MTP draft, a batch of one row) runs its exchange beside an empty partner, and a layer a rank
only joins runs as two empty exchanges. Every exchange having the same number of steps whatever its rows,
the collectives are issued in the same order on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv3.errors import DSV3Error
from dsv3.model.dispatch import Routing, Steps, TokenDispatcher, run
from dsv3.model.moe import MoE
from dsv3.parallel.ep import ExpertParallelDispatcher, make_expert_parallel, set_placement
from dsv3.parallel.ep_groups import ep_groups_of
from dsv3.parallel.eplb import global_policy, imbalance
from dsv3.parallel.overlap import run_interleaved
from dsv3.parallel.placement import Placement

DONE = -1  # a rank whose work for this step is over


class LockstepBroken(DSV3Error):
    """A failure inside a round: the ranks' collectives can no longer be matched, so serving must stop."""


@dataclass
class _Handle:
    inner: Any  # the EP dispatcher's handle
    after: list[int] | None  # layers to join (with zero tokens) once this layer's combine is done; None: half 1
    partner: Steps | None = None  # the empty exchange paired with a forward that is not split (dual mode)


def _alongside(own: Steps, partner: Steps | None) -> Steps:
    """Generator: ``own``'s steps, each followed by one step of ``partner`` (the empty half of a pair), so
    the pair issues its collectives in the order two interleaved micro-batches would; returns own's value."""
    if partner is None:
        return (yield from own)
    while True:
        try:
            next(own)
        except StopIteration as done:
            return done.value
        next(partner, None)
        yield


class Lockstep:
    """The rounds of one EP group: ``layers`` are its MoE layers (the MTP layer's last), each already given a
    ``LockstepDispatcher`` over this coordinator by :func:`make_lockstep`."""

    def __init__(self, layers: list[MoE], group: dist.ProcessGroup | None, dtype: torch.dtype,
                 micro_batches: int = 1):
        self.layers, self.group, self.dtype = layers, group, dtype
        self.world = dist.get_world_size(group)
        self.micro_batches = micro_batches  # 2: every exchange is one of a pair (dual micro-batch decode)
        self.half: int | None = None  # the half of a split forward ``run_pair`` is advancing; None: not split
        self.rounds = 0  # rounds run (statistics and tests)
        self.busy_rounds = 0  # rounds in which this rank ran a layer of its own
        self.split_forwards = 0  # forwards run as two halves (``run_pair``; statistics and tests)
        self.open = 0  # rounds entered (or being joined) whose exchanges are not all done yet
        self.gather_s = 0.0  # time in the rounds' gathers (part of the exchanges' cost; benchmarks)
        self.rebalances = 0
        self.imbalance: tuple[float, float] | None = None  # max/mean rank load at the last rebalance: before, after

    @property
    def in_round(self) -> bool:
        """True between a round's gather and its last exchange: a failure then leaves collectives unmatched."""
        return self.open > 0

    def gather(self, want: int) -> list[int]:
        """All ranks' wishes for this round (a layer index or DONE), in rank order."""
        t0 = time.perf_counter()
        mine = torch.tensor([want], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        self.rounds += 1
        self.gather_s += time.perf_counter() - t0
        return [int(t) for t in out]

    def enter(self, layer: int) -> list[int]:
        """Start a round asking for ``layer``: joins the layers asked for before it (in order), and returns
        those after it, to join once this rank's own exchange is done."""
        self.open += 1
        wanted = sorted({w for w in self.gather(layer) if w != DONE})
        self.busy_rounds += 1
        for w in wanted:
            if w < layer:
                self.join_empty(w)
        return [w for w in wanted if w > layer]

    def leave(self, after: list[int]) -> None:
        for w in after:
            self.join_empty(w)
        self.open -= 1

    def finish(self) -> None:
        """This rank's work for the step is over: join the others' rounds until every rank is done."""
        while True:
            wanted = sorted({w for w in self.gather(DONE) if w != DONE})
            if not wanted:
                return
            self.open += 1
            for w in wanted:
                self.join_empty(w)
            self.open -= 1

    def run_pair(self, steps: list[Generator]) -> list:
        """Drive the forwards of a decode step's two halves (the engine's ``drive`` in dual mode): round-robin
        like ``run_interleaved``, telling the dispatchers which half each step belongs to, so that each MoE
        layer's two exchanges make one pair of one round. Returns the halves' values in order."""
        if self.micro_batches != 2 or len(steps) != 2:
            raise DSV3Error(f"a split forward needs a dual micro-batch lockstep and two halves, got "
                            f"micro_batches={self.micro_batches} and {len(steps)} halves")
        self.split_forwards += 1
        results: list = [None, None]
        active = [0, 1]
        try:
            while active:
                for i in list(active):
                    self.half = i
                    try:
                        next(steps[i])
                    except StopIteration as done:
                        results[i] = done.value
                        active.remove(i)
        finally:
            self.half = None
        return results

    def routed_counts(self) -> list[list[int]]:
        """Tokens this rank's routers sent to each logical expert of each MoE layer since the start (the MTP
        layer's last): the expert load ``/metrics`` reports per rank."""
        return [moe.dispatcher.routed.tolist() for moe in self.layers]

    @torch.no_grad()
    def rebalance(self) -> None:
        """EPLB at a step boundary: every layer's expert load since the last rebalance, summed over the group,
        gives a new placement of its expert slots (replicas of the hot experts included, the same on every
        rank), and the weights move to it. Routing is logical and every replica is an exact copy, so the
        requests in flight decode on unchanged. Every rank of the group must call it at the same step."""
        before, after = [], []
        for moe in self.layers:
            d: LockstepDispatcher = moe.dispatcher
            load = d.load.clone()
            dist.all_reduce(load, group=self.group)  # the same on every rank: so are the choices below
            d.load.zero_()
            if not bool(load.any()):  # no tokens since the last rebalance: nothing to learn, nothing moves
                continue
            old = d.inner.placement
            new = Placement(global_policy(load, old.phy2log.numel(), self.world), self.world)
            before.append(imbalance(old.phy2log, load, self.world))
            after.append(imbalance(new.phy2log, load, self.world))
            moe.dispatcher = d.inner  # set_placement talks to the EP dispatcher itself
            try:
                set_placement(moe, new)
            finally:
                moe.dispatcher = d
        if before:
            self.rebalances += 1
            self.imbalance = max(before), max(after)

    @torch.inference_mode()
    def join_empty(self, layer: int) -> None:
        """Layer ``layer``'s exchange with no tokens from this rank (a pair of them in dual mode): its experts
        compute what others send."""
        if self.micro_batches == 2:
            run_interleaved([self.empty_exchange(layer), self.empty_exchange(layer)])
        else:
            run(self.empty_exchange(layer))

    def empty_exchange(self, layer: int) -> Steps:
        """Generator: layer ``layer``'s dispatch, expert compute and combine with zero tokens from this rank
        (no grad mode of its own: a mode entered here would leak out at every yield)."""
        moe = self.layers[layer]
        inner = moe.dispatcher.inner
        k, dim = moe.top_k, moe.gate.weight.shape[1]
        x = torch.empty(0, dim, dtype=self.dtype)
        routing = Routing(torch.empty(0, k, dtype=torch.long), torch.empty(0, k, dtype=torch.float32))
        rows, handle = yield from inner.dispatch(x, routing)
        yield from inner.combine(moe.experts(rows), handle)


class LockstepDispatcher(TokenDispatcher):
    """The EP dispatcher of layer ``index``, wrapped so that its exchange runs inside a round."""

    def __init__(self, lockstep: Lockstep, index: int, inner: ExpertParallelDispatcher):
        super().__init__()
        self.lockstep, self.index, self.inner = lockstep, index, inner
        self.load = torch.zeros(inner.n_experts, dtype=torch.float64)  # tokens per logical expert, this rank
        self.routed = torch.zeros(inner.n_experts, dtype=torch.long)  # the same, never reset (/metrics)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Steps:
        """Generator: the round's start (unless this is half 1 of a split forward, whose half 0 opened it),
        then the exchange, beside an empty partner when a dual-mode forward is not split."""
        counts = torch.bincount(routing.idx.flatten().cpu(), minlength=self.load.numel())
        self.load += counts
        self.routed += counts
        lockstep = self.lockstep
        if lockstep.half == 1:
            lockstep.open += 1
            rows, handle = yield from self.inner.dispatch(x, routing)
            return rows, _Handle(handle, None)
        after = lockstep.enter(self.index)
        partner = lockstep.empty_exchange(self.index) if lockstep.micro_batches == 2 and lockstep.half is None \
            else None
        rows, handle = yield from _alongside(self.inner.dispatch(x, routing), partner)
        return rows, _Handle(handle, after, partner)

    def combine(self, y: torch.Tensor, handle: _Handle) -> Steps:
        """Generator: the exchange back, then the layers asked for after this one (not for half 1: its half 0
        joins them, once its own combine is done; half 1's last collective is already issued by then)."""
        out = yield from _alongside(self.inner.combine(y, handle.inner), handle.partner)
        if handle.partner is not None:
            run(handle.partner)  # its last wait
        if handle.after is None:
            self.lockstep.open -= 1
        else:
            self.lockstep.leave(handle.after)
        return out


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the hidden states (the embedding's): what the wire must carry to lose nothing."""
    return model.model.embed_tokens.weight.dtype


def native_format(model: torch.nn.Module) -> str:
    """The wire format that carries the compute dtype exactly: results then equal one process's."""
    return "bf16" if compute_dtype(model) == torch.bfloat16 else "fp32"


def make_lockstep(model: torch.nn.Module, partitions: list[list[int]], dispatch: str = "native",
                  combine: str = "native", redundant: int = 0) -> Lockstep:
    """Make every MoE layer of ``model`` (a full single-process model, the same on every rank) expert-parallel
    over this rank's partition of the world (``partitions``: disjoint lists of global ranks covering it) and
    lockstepped there. Every rank of the world must call it alike (it creates process groups for every
    partition). Returns this rank's coordinator (single micro-batch: see ``use_micro_batches``)."""
    native = native_format(model)
    dispatch = native if dispatch == "native" else dispatch
    combine = native if combine == "native" else combine
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise DSV3Error("the model has no MoE layers: expert parallelism has nothing to spread")
    mine = None
    for members in partitions:
        whole = len(members) == dist.get_world_size()
        group = None if whole else dist.new_group(members)
        groups = ep_groups_of(members, len(members), group)
        if groups is not None:
            mine = group, groups
    if mine is None:
        raise DSV3Error(f"rank {dist.get_rank()} is in no serving group")
    group, groups = mine
    lockstep = Lockstep(layers, group, compute_dtype(model))
    placement = group_placement(layers[0].n_experts, groups.layout.world, redundant)
    for i, moe in enumerate(layers):
        make_expert_parallel(moe, groups, placement, dispatch, combine)
        moe.dispatcher = LockstepDispatcher(lockstep, i, moe.dispatcher)
    return lockstep


def group_placement(n_experts: int, size: int, redundant: int = 0) -> Placement:
    """Where the ``n_experts`` routed experts (plus ``redundant`` replicas, placed by EPLB's global policy
    for a uniform load) sit over an EP group of ``size`` ranks: pure arithmetic, so that a rank knows which
    experts to load before the group exists."""
    if not redundant:
        return Placement.contiguous(n_experts, size)
    if (n_experts + redundant) % size:
        raise DSV3Error(f"--redundant-experts {redundant}: {n_experts} experts + {redundant} replicas cannot be "
                        f"spread evenly over an EP group of {size} ranks")
    return Placement(global_policy(torch.ones(n_experts), n_experts + redundant, size), size)


def use_micro_batches(engine: Any, lockstep: Lockstep, n: int) -> None:
    """Dual micro-batch decode on (``n`` 2) or off (1) for this rank's engine and lockstep together: every
    rank of the lockstep's group must make the same choice at the same step boundary."""
    if n not in (1, 2):
        raise DSV3Error(f"--micro-batches must be 1 or 2, got {n}")
    lockstep.micro_batches = engine.micro_batches = n
    engine.drive = lockstep.run_pair


def ep_formats(d: ExpertParallelDispatcher) -> tuple[str, str]:
    """(dispatch, combine) wire format names of an EP dispatcher."""
    return d.formats.dispatch.name, d.formats.combine_inter.name
