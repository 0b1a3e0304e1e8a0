"""The expert-parallel token dispatcher: the two-hop dispatch/combine of `exchange.py`, differentiable,
behind the same interface as the model's `LocalDispatcher`. `make_expert_parallel` gives one `MoE` this
dispatcher and keeps only this rank's share of its grouped experts (of whatever kind: plain, FP8 training
GEMMs); router, shared experts and the rest of the layer are the single-process code. `parallelize` applies
it to every MoE layer over the EP groups of the layout's mesh.

Routing is the replicated `Router`, so decisions are the single-process model's; with ``n_group`` a
multiple of the node count each group lives on one node, so ``topk_group`` caps the nodes a token visits.
Gradients: dispatch's backward is a two-hop reduce (in the combine format), combine's backward a two-hop
broadcast (in the dispatch format), the V3 choice of FP8 for the gradient entering the down-projection and
BF16 for the combine direction. The data-parallel axis (`dsv3.parallel.data_parallel`) then sums what the
replicas hold.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.model.dispatch import ExpertRows, Routing, Steps, TokenDispatcher, group_by_expert, run
from dsv3.model.moe import MoE
from dsv3.parallel.ep_groups import EPGroups
from dsv3.parallel.exchange import TrafficMeter, TwoHopPlan, broadcast, handshake, reduce
from dsv3.parallel.overlap import run_interleaved
from dsv3.parallel.placement import Placement
from dsv3.parallel.wire import COMBINE_FORMATS, DISPATCH_FORMATS, WireFormat, wire_format


@dataclass(frozen=True)
class WireFormats:
    """Dispatch-direction format (both hops, encoded once) and combine-direction formats per hop: the
    intra-node hop of a LogFMT combine stays BF16 (cheap NVLink), the inter-node hop is compressed."""

    dispatch: WireFormat
    combine_intra: WireFormat
    combine_inter: WireFormat

    @classmethod
    def named(cls, dispatch: str, combine: str) -> WireFormats:
        d, c = wire_format(dispatch, DISPATCH_FORMATS), wire_format(combine, COMBINE_FORMATS)
        intra = WireFormat("bf16") if c.name.startswith("logfmt") else c
        return cls(d, intra, c)


class _Dispatch(torch.autograd.Function):
    """(x [N, D], w [N, K]) -> rows on the expert ranks; the forward result comes precomputed by the async
    steps (``done``), the backward is the synchronous two-hop reduce of the gradients."""

    @staticmethod
    def forward(ctx, x, w, plan: TwoHopPlan, formats: WireFormats, done):
        ctx.plan, ctx.formats, ctx.x_dtype, ctx.dim = plan, formats, x.dtype, x.shape[1]
        return done[0], done[1]

    @staticmethod
    def backward(ctx, gx_e, gw_e):
        plan, f = ctx.plan, ctx.formats
        rows = plan.expert_slots.shape[0]
        gx_e = gx_e if gx_e is not None else plan.expert_slots.new_zeros(rows, ctx.dim, dtype=ctx.x_dtype)
        gw_e = (
            gw_e if gw_e is not None else plan.expert_slots.new_zeros(rows, plan.top_k, dtype=torch.float32)
        )
        gx, gw = run(reduce(plan, gx_e, f.combine_intra, f.combine_inter, extra=gw_e, phase="backward"))
        return gx.to(ctx.x_dtype), gw, None, None, None


class _Combine(torch.autograd.Function):
    """y_e [R2r, D] partial outputs -> y [N, D] at the sources; backward broadcasts the output gradient."""

    @staticmethod
    def forward(ctx, y_e, plan: TwoHopPlan, formats: WireFormats, done):
        ctx.plan, ctx.formats = plan, formats
        return done

    @staticmethod
    def backward(ctx, gy):
        g_e, _ = run(broadcast(ctx.plan, gy.contiguous(), ctx.formats.dispatch, phase="backward"))
        return g_e, None, None, None


@dataclass
class _Handle:
    """What combine needs from dispatch: the plan of both hops and when dispatch finished (for timing)."""

    plan: TwoHopPlan
    clock: float


class ExpertParallelDispatcher(TokenDispatcher):
    """Dispatches a MoE layer's rows over an EP group: each rank holds ``placement``'s slots of experts.
    Every rank of the group must run every MoE forward (and backward): they are collectives."""

    def __init__(
        self,
        n_experts: int,
        dim: int,
        groups: EPGroups,
        placement: Placement | None = None,
        dispatch: str = "bf16",
        combine: str = "bf16",
    ):
        super().__init__()
        self.n_experts, self.groups = n_experts, groups
        self.formats = WireFormats.named(dispatch, combine)
        self.formats.combine_inter.check(dim)
        self.placement = placement or Placement.contiguous(n_experts, groups.layout.world)
        self.check_placement(self.placement)
        self.register_buffer("expert_ids", self.placement.rank_experts(groups.rank).clone(), persistent=False)
        self.meter = TrafficMeter()
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.last_slots: torch.Tensor | None = None  # routing of the last forward (for traffic checks)
        self.last_expert_slots: torch.Tensor | None = None  # what this rank's experts got last forward

    def check_placement(self, p: Placement) -> None:
        world = self.groups.layout.world
        if p.world != world:
            raise DSV3Error(f"placement is for {p.world} EP ranks, the EP group has {world}")
        if p.n_experts != self.n_experts or bool((p.replica_counts == 0).any()):
            raise DSV3Error(f"placement must hold every one of the {self.n_experts} routed experts")

    def node_limit(self, gate: nn.Module) -> int | None:
        """Most nodes a token can visit (the router's topk_group), or None when groups are not node-aligned."""
        aligned = gate.method != "greedy" and self.placement.is_node_aligned(
            gate.n_group, self.groups.layout.gpus_per_node
        )
        return gate.topk_group if aligned else None

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Steps:
        """Generator: x [N, D] to the ranks holding the experts each token chose; returns the rows this
        rank's experts compute (received rows, their (row, local slot, gate) pairs) and a handle."""
        slots = self.placement.choose_slots(routing.idx.cpu(), salt=self.groups.rank).to(routing.idx.device)
        self.last_slots = slots
        clock = time.perf_counter()
        plan = yield from handshake(slots, self.groups, self.placement.slots_per_rank, self.meter)
        done = yield from broadcast(plan, x.detach(), self.formats.dispatch, extra=routing.weights.detach())
        x_e, w_e = _Dispatch.apply(x, routing.weights, plan, self.formats, done)
        self.last_expert_slots = plan.expert_slots
        rows = _local_rows(x_e, plan.expert_slots, w_e, self.placement.slots_per_rank)
        return rows, _Handle(plan, self._tick("dispatch", clock))

    def combine(self, y: torch.Tensor, handle: _Handle) -> Steps:
        """Generator: this rank's per-row partial sums y [R, D] back to their tokens' ranks, summed; [N, D]."""
        clock = self._tick("experts", handle.clock)
        f = self.formats
        out, _ = yield from reduce(handle.plan, y.detach(), f.combine_intra, f.combine_inter)
        out = _Combine.apply(y, handle.plan, f, out)
        self._tick("combine", clock)
        return out

    def _tick(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.stage_seconds[stage] += now - since
        return now

    def extra_repr(self) -> str:
        layout = self.groups.layout
        return (f"rank={self.groups.rank}/{layout.world}, gpus_per_node={layout.gpus_per_node}, "
                f"experts_here={self.expert_ids.numel()}, dispatch={self.formats.dispatch.name}, "
                f"combine={self.formats.combine_inter.name}")


def _local_rows(x_e: torch.Tensor, slots: torch.Tensor, w_e: torch.Tensor, n_local: int) -> ExpertRows:
    """Received rows x_e [R, D] with local slots [R, K] (-1: elsewhere) and gates w_e [R, K] -> the pairs
    of this rank's experts, grouped by slot. On a rank that got no tokens the (empty) rows and gates still
    reach the experts, so that its backward joins the collectives (and its expert grads are zeros)."""
    rows, ks = (slots >= 0).nonzero(as_tuple=True)
    return group_by_expert(x_e, rows, slots[rows, ks], w_e[rows, ks], n_local)


def forward_micro_batches(moe: MoE, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dual micro-batch overlap: one micro-batch's dispatch/combine is in flight while the other computes
    (round-robin over their steps)."""
    return run_interleaved([moe.steps(x) for x in xs])


# ---- placement changes ------------------------------------------------------------------------


@torch.no_grad()
def logical_expert_weights(moe: MoE) -> dict[str, torch.Tensor]:
    """All logical experts' weights [E, ...] of an expert-parallel layer on every rank (one replica each,
    via all_reduce). Simple and memory-hungry: meant for small models, saving, tests and rebalancing."""
    d: ExpertParallelDispatcher = moe.dispatcher
    first = torch.zeros(d.placement.phy2log.numel(), dtype=torch.bool)
    seen = set()
    for p, e in enumerate(d.placement.phy2log.tolist()):
        first[p] = e not in seen
        seen.add(e)
    S, r = d.placement.slots_per_rank, d.groups.rank
    mine = first[r * S : (r + 1) * S]
    out = {}
    for name, p in moe.experts.named_parameters():
        buf = p.new_zeros(d.n_experts, *p.shape[1:])
        mine = mine.to(p.device)
        buf.index_add_(0, d.expert_ids[mine], p[mine])
        dist.all_reduce(buf, group=d.groups.ep)
        out[name] = buf
    return out


@torch.no_grad()
def set_placement(moe: MoE, placement: Placement) -> None:
    """Move an expert-parallel layer to a new placement (e.g. from EPLB); each rank ends up with its new
    slots' weights, in experts of the same kind."""
    d: ExpertParallelDispatcher = moe.dispatcher
    d.check_placement(placement)
    weights = logical_expert_weights(moe)
    d.placement = placement
    ids = placement.rank_experts(d.groups.rank)
    d.expert_ids = ids.to(d.expert_ids.device)
    full = moe.experts.select(torch.zeros(0, dtype=torch.long))  # an empty shard of the same kind ...
    for name, w in weights.items():
        setattr(full, name, nn.Parameter(w))  # ... holding every logical expert
    moe.experts = full.select(ids)


def make_expert_parallel(
    moe: MoE,
    groups: EPGroups,
    placement: Placement | None = None,
    dispatch: str = "bf16",
    combine: str = "bf16",
) -> MoE:
    """Make one `MoE` expert-parallel in place: the two-hop dispatcher, and of its experts only this rank's
    slots (copies, of the same kind): selected from a full single-process layer, or already all that a
    loader kept (`MoE.hold_experts`), which must be exactly those slots. Returns the layer."""
    dim = moe.experts.gate_proj.shape[2]
    dispatcher = ExpertParallelDispatcher(moe.n_experts, dim, groups, placement, dispatch, combine)
    moe.dispatcher = dispatcher.to(moe.expert_load.device)
    ids = moe.dispatcher.expert_ids
    if moe.held_experts is None:
        moe.experts = moe.experts.select(ids)
    elif not torch.equal(moe.held_experts.cpu(), ids.cpu()):
        raise DSV3Error(f"this rank loaded experts {moe.held_experts.tolist()} but its EP slots hold {ids.tolist()}")
    moe.held_experts = None  # the dispatcher's expert_ids say which experts are here from now on
    return moe


def ep_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model`` whose experts are spread over an EP group."""
    return [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.dispatcher, ExpertParallelDispatcher)]
