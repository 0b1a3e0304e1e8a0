"""The expert-parallel DeepSeekMoE layer: the single-process `MoE`'s router and shared experts, this rank's
routed experts only, and the two-hop dispatch/combine of `exchange.py` in between, differentiable.

Routing is the replicated `Router`, so decisions are the single-process model's; with ``n_group`` a
multiple of the node count each group lives on one node, so ``topk_group`` caps the nodes a token visits.
Gradients: dispatch's backward is a two-hop reduce (in the combine format), combine's backward a two-hop
broadcast (in the dispatch format), the V3 choice of FP8 for the gradient entering the down-projection and
BF16 for the combine direction. ``sync_grads`` then gives data-parallel averaging for everything.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.model.moe import Experts, MoE, routed_swiglu
from dsv3.parallel.exchange import TrafficMeter, TwoHopPlan, broadcast, handshake, reduce, run
from dsv3.parallel.overlap import run_interleaved
from dsv3.parallel.placement import Placement
from dsv3.parallel.topology import EPGroups, make_ep_groups
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


class ExpertParallelMoE(MoE):
    """A `MoE` whose routed experts are sharded over an EP group; same forward contract ([B, T, D])."""

    def __init__(
        self,
        moe: MoE,
        groups: EPGroups,
        placement: Placement | None = None,
        dispatch: str = "bf16",
        combine: str = "bf16",
    ):
        nn.Module.__init__(self)
        self.n_experts, self.top_k, self.aux_alpha = moe.n_experts, moe.top_k, moe.aux_alpha
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.groups = groups
        self.formats = WireFormats.named(dispatch, combine)
        self.formats.combine_inter.check(moe.experts.gate_proj.shape[2])
        self.placement = placement or Placement.contiguous(moe.n_experts, groups.layout.world)
        self._check_placement()
        ids = self.placement.rank_experts(groups.rank)
        self.register_buffer("expert_ids", ids.clone(), persistent=False)
        full = moe.experts
        self.experts = Experts(ids.numel(), full.gate_proj.shape[2], full.gate_proj.shape[1]).to(
            full.gate_proj
        )
        with torch.no_grad():
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(self.experts, name).copy_(getattr(full, name)[ids])
        self.register_buffer("expert_load", moe.expert_load.clone(), persistent=False)
        self.aux_loss = None
        self.meter = TrafficMeter()
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.last_slots: torch.Tensor | None = None  # routing of the last forward (for traffic checks)
        self.last_expert_slots: torch.Tensor | None = None  # what this rank's experts got last forward

    def _check_placement(self) -> None:
        p, world = self.placement, self.groups.layout.world
        if p.world != world:
            raise DSV3Error(f"placement is for {p.world} EP ranks, the EP group has {world}")
        if p.n_experts != self.n_experts or bool((p.replica_counts == 0).any()):
            raise DSV3Error(f"placement must hold every one of the {self.n_experts} routed experts")

    @property
    def node_limit(self) -> int | None:
        """Most nodes a token can visit (topk_group), or None when groups are not node-aligned."""
        g = self.gate
        aligned = g.method != "greedy" and self.placement.is_node_aligned(
            g.n_group, self.groups.layout.gpus_per_node
        )
        return g.topk_group if aligned else None

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]; collectives in the EP group (every rank must call it)."""
        return run(self.steps(x))

    def forward_micro_batches(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Dual micro-batch overlap: one micro-batch's dispatch/combine is in flight while the other
        computes (round-robin over their steps)."""
        return run_interleaved([self.steps(x) for x in xs])

    def steps(self, x: torch.Tensor):
        """Generator: the layer's forward, yielding whenever a collective is in flight; returns [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        idx, weights, scores = self.gate(flat)
        if self.training:
            self._count_load(idx)
            self.aux_loss = self._sequence_balance_loss(idx.view(B, T, -1), scores.view(B, T, -1))
        slots = self.placement.choose_slots(idx.cpu(), salt=self.groups.rank).to(idx.device)
        self.last_slots = slots
        clock = time.perf_counter()
        plan = yield from handshake(slots, self.groups, self.placement.slots_per_rank, self.meter)
        done = yield from broadcast(plan, flat.detach(), self.formats.dispatch, extra=weights.detach())
        x_e, w_e = _Dispatch.apply(flat, weights, plan, self.formats, done)
        self.last_expert_slots = plan.expert_slots
        clock = self._tick("dispatch", clock)
        y_e = self._local_experts(x_e, plan.expert_slots, w_e)
        clock = self._tick("experts", clock)
        f = self.formats
        y, _ = yield from reduce(plan, y_e.detach(), f.combine_intra, f.combine_inter)
        out = _Combine.apply(y_e, plan, f, y).view(B, T, D)
        self._tick("combine", clock)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _tick(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.stage_seconds[stage] += now - since
        return now

    def _count_load(self, idx: torch.Tensor) -> None:
        """Global tokens per logical expert (summed over the EP group), so the aux-free update is the same
        on every rank and equals the single-process one."""
        load = torch.bincount(idx.flatten(), minlength=self.n_experts).float()
        dist.all_reduce(load, group=self.groups.ep)
        self.expert_load += load.to(self.expert_load)

    def _local_experts(self, x_e: torch.Tensor, slots: torch.Tensor, w_e: torch.Tensor) -> torch.Tensor:
        """Rows x_e [R, D] with local slots [R, K] (-1: elsewhere) and gates w_e [R, K] -> per-row sum of
        this rank's weighted expert outputs [R, D]."""
        rows, ks = (slots >= 0).nonzero(as_tuple=True)
        slot = slots[rows, ks]
        order = slot.argsort(stable=True)
        rows, ks, slot = rows[order], ks[order], slot[order]
        counts = torch.bincount(slot, minlength=self.experts.gate_proj.shape[0]).tolist()
        e = self.experts
        # On a rank that got no tokens this still keeps x_e and the gates in the graph, so its backward
        # joins the collectives (and its expert grads are zeros, not None).
        return routed_swiglu(x_e, w_e[rows, ks], rows, counts, e.gate_proj, e.up_proj, e.down_proj)

    # ---- placement changes --------------------------------------------------------------------
    @torch.no_grad()
    def logical_expert_weights(self) -> dict[str, torch.Tensor]:
        """All logical experts' weights [E, ...] on every rank (one replica each, via all_reduce).
        Simple and memory-hungry: meant for small models, tests and rebalancing demos."""
        first = torch.zeros(self.placement.phy2log.numel(), dtype=torch.bool)
        seen = set()
        for p, e in enumerate(self.placement.phy2log.tolist()):
            first[p] = e not in seen
            seen.add(e)
        S, r = self.placement.slots_per_rank, self.groups.rank
        mine = first[r * S : (r + 1) * S]
        out = {}
        for name, p in self.experts.named_parameters():
            buf = p.new_zeros(self.n_experts, *p.shape[1:])
            mine = mine.to(p.device)
            buf.index_add_(0, self.expert_ids[mine], p[mine])
            dist.all_reduce(buf, group=self.groups.ep)
            out[name] = buf
        return out

    @torch.no_grad()
    def set_placement(self, placement: Placement) -> None:
        """Move to a new placement (e.g. from EPLB); each rank ends up with its new slots' weights."""
        weights = self.logical_expert_weights()
        self.placement = placement
        self._check_placement()
        ids = placement.rank_experts(self.groups.rank)
        self.expert_ids = ids.to(self.expert_ids.device)
        shape = weights["gate_proj"].shape
        self.experts = Experts(ids.numel(), shape[2], shape[1]).to(weights["gate_proj"])
        for name, full in weights.items():
            getattr(self.experts, name).copy_(full[ids])


def apply_expert_parallel(
    model: nn.Module,
    gpus_per_node: int,
    group: dist.ProcessGroup | None = None,
    dispatch: str = "bf16",
    combine: str = "bf16",
    placement: Placement | None = None,
) -> nn.Module:
    """Swap every `MoE` of ``model`` for an `ExpertParallelMoE` holding this rank's experts only.

    Every rank must call it with the same full model (same seed or checkpoint): experts are sliced from
    it. The rest of the model stays replicated (data parallel); average its gradients with `sync_grads`.
    """
    groups = make_ep_groups(gpus_per_node, group)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is MoE
    ]
    if not targets:
        raise DSV3Error("the model has no MoE layers to make expert-parallel")
    for parent, name, moe in targets:
        setattr(parent, name, ExpertParallelMoE(moe, groups, placement, dispatch, combine))
    return model


def ep_layers(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


@torch.no_grad()
def sync_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Data-parallel gradient averaging for an EP model, where each rank's loss is the mean over its
    own tokens: replicated parameters are all-reduced and averaged; a rank's experts already hold the
    sum over every rank's tokens, so they are divided by the world size (replicas are summed first)."""
    world = dist.get_world_size(group)
    layers = ep_layers(model)
    expert_ids = {id(p) for m in layers for p in m.experts.parameters()}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
    for p in dense:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dense:
        flat = torch.cat([p.grad.reshape(-1).float() for p in dense])
        dist.all_reduce(flat, group=group)
        flat /= world
        for p, g in zip(dense, flat.split([p.numel() for p in dense]), strict=True):
            p.grad.copy_(g.view_as(p))
    for m in layers:
        replicated = bool((m.placement.replica_counts > 1).any())
        for p in m.experts.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if replicated:
                buf = p.grad.new_zeros(m.n_experts, *p.shape[1:])
                buf.index_add_(0, m.expert_ids, p.grad)
                dist.all_reduce(buf, group=m.groups.ep)
                p.grad.copy_(buf[m.expert_ids])
            p.grad /= world
