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
"""

from __future__ import annotations

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
from dsv3.parallel.placement import Placement

DONE = -1  # a rank whose work for this step is over


class LockstepBroken(DSV3Error):
    """A failure inside a round: the ranks' collectives can no longer be matched, so serving must stop."""


@dataclass
class _Handle:
    inner: Any  # the EP dispatcher's handle
    after: list[int]  # layers to join (with zero tokens) once this layer's combine is done


class Lockstep:
    """The rounds of one EP group: ``layers`` are its MoE layers (the MTP layer's last), each already given a
    ``LockstepDispatcher`` over this coordinator by :func:`make_lockstep`."""

    def __init__(self, layers: list[MoE], group: dist.ProcessGroup | None, dtype: torch.dtype):
        self.layers, self.group, self.dtype = layers, group, dtype
        self.world = dist.get_world_size(group)
        self.rounds = 0  # rounds run (statistics and tests)
        self.busy_rounds = 0  # rounds in which this rank ran a layer of its own
        self.in_round = False  # set between a round's gather and its last exchange
        self.rebalances = 0
        self.imbalance: tuple[float, float] | None = None  # max/mean rank load at the last rebalance: before, after

    def gather(self, want: int) -> list[int]:
        """All ranks' wishes for this round (a layer index or DONE), in rank order."""
        mine = torch.tensor([want], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        self.rounds += 1
        return [int(t) for t in out]

    def enter(self, layer: int) -> list[int]:
        """Start a round asking for ``layer``: joins the layers asked for before it (in order), and returns
        those after it, to join once this rank's own exchange is done."""
        wanted = sorted({w for w in self.gather(layer) if w != DONE})
        self.in_round = True
        self.busy_rounds += 1
        for w in wanted:
            if w < layer:
                self.join_empty(w)
        return [w for w in wanted if w > layer]

    def leave(self, after: list[int]) -> None:
        for w in after:
            self.join_empty(w)
        self.in_round = False

    def finish(self) -> None:
        """This rank's work for the step is over: join the others' rounds until every rank is done."""
        while True:
            wanted = sorted({w for w in self.gather(DONE) if w != DONE})
            if not wanted:
                return
            self.in_round = True
            for w in wanted:
                self.join_empty(w)
            self.in_round = False

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
        """Layer ``layer``'s exchange with no tokens from this rank: its experts compute what others send."""
        moe = self.layers[layer]
        inner = moe.dispatcher.inner
        k, dim = moe.top_k, moe.gate.weight.shape[1]
        x = torch.empty(0, dim, dtype=self.dtype)
        routing = Routing(torch.empty(0, k, dtype=torch.long), torch.empty(0, k, dtype=torch.float32))
        rows, handle = run(inner.dispatch(x, routing))
        run(inner.combine(moe.experts(rows), handle))


class LockstepDispatcher(TokenDispatcher):
    """The EP dispatcher of layer ``index``, wrapped so that its exchange runs inside a round."""

    def __init__(self, lockstep: Lockstep, index: int, inner: ExpertParallelDispatcher):
        super().__init__()
        self.lockstep, self.index, self.inner = lockstep, index, inner
        self.load = torch.zeros(inner.n_experts, dtype=torch.float64)  # tokens per logical expert, this rank
        self.routed = torch.zeros(inner.n_experts, dtype=torch.long)  # the same, never reset (/metrics)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Steps:
        counts = torch.bincount(routing.idx.flatten().cpu(), minlength=self.load.numel())
        self.load += counts
        self.routed += counts
        after = self.lockstep.enter(self.index)
        rows, handle = yield from self.inner.dispatch(x, routing)
        return rows, _Handle(handle, after)

    def combine(self, y: torch.Tensor, handle: _Handle) -> Steps:
        out = yield from self.inner.combine(y, handle.inner)
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
    partition). Returns this rank's coordinator."""
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
    placement = None
    if redundant:
        size = groups.layout.world
        n = layers[0].n_experts
        if (n + redundant) % size:
            raise DSV3Error(f"--redundant-experts {redundant}: {n} experts + {redundant} replicas cannot be "
                            f"spread evenly over an EP group of {size} ranks")
        placement = Placement(global_policy(torch.ones(n), n + redundant, size), size)
    for i, moe in enumerate(layers):
        make_expert_parallel(moe, groups, placement, dispatch, combine)
        moe.dispatcher = LockstepDispatcher(lockstep, i, moe.dispatcher)
    return lockstep


def ep_formats(d: ExpertParallelDispatcher) -> tuple[str, str]:
    """(dispatch, combine) wire format names of an EP dispatcher."""
    return d.formats.dispatch.name, d.formats.combine_inter.name
