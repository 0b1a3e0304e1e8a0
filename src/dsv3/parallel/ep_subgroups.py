"""Expert parallelism over PART of the data-parallel ranks (``Layout(dp=D, ep=E)``, E | D, E < D), as V3
does: its EP64 borrows 64 of the data-parallel ranks (8 nodes of 8) and the routed experts are replicated
across the D/E such groups.

Two kinds of group over the D data-parallel ranks:

* **EP groups**: consecutive blocks of E ranks (``[0..E)``, ``[E..2E)``, ...), so that an EP group fills
  whole nodes and its two-hop all-to-all stays inside the block. Each block holds every routed expert once,
  split E ways behind the ordinary `ExpertParallelDispatcher`.
* **expert-replica groups**: the D/E ranks that hold the same expert shard (stride E: ``{i, i+E, ...}``).
  The routed experts are data parallel over these.

Gradients then follow from the single-process step's loss (the mean over all D ranks' tokens):
`sync_grads` averages the replicated (dense) parameters over all D ranks and divides each rank's expert
gradients, which the dispatcher has already summed over its EP group's tokens, by D; the all-reduce over
the replica group adds the other EP groups' tokens. Every replica then holds the same gradient, applies
the same AdamW update and stays equal to the others without any broadcast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.model.dispatch import LocalDispatcher
from dsv3.model.moe import MoE
from dsv3.parallel.ep import ep_layers, make_expert_parallel, sync_grads
from dsv3.parallel.ep_groups import EPGroups, NodeLayout, ep_groups_of
from dsv3.parallel.layout import ExpertParallelized


@dataclass(frozen=True)
class SubgroupLayout:
    """Which ranks form which group, for ``dp`` ranks with EP groups of ``ep``; pure arithmetic (the
    tests and the docs use it without processes)."""

    dp: int
    ep: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.ep < 1 or self.dp < 1 or self.dp % self.ep:
            raise DSV3Error(f"--ep {self.ep} must divide the number of data-parallel processes ({self.dp})")
        NodeLayout(self.ep, self.gpus_per_node)  # raises when the EP group is not whole nodes

    @property
    def replicas(self) -> int:
        """How many copies of every expert there are (the number of EP groups)."""
        return self.dp // self.ep

    def ep_ranks(self, block: int) -> list[int]:
        """Global ranks of EP group ``block``, in EP-rank order (consecutive: whole nodes)."""
        return list(range(block * self.ep, (block + 1) * self.ep))

    def replica_ranks(self, shard: int) -> list[int]:
        """Global ranks holding expert shard ``shard`` (EP rank ``shard`` of every EP group)."""
        return list(range(shard, self.dp, self.ep))

    def block_of(self, rank: int) -> int:
        return rank // self.ep

    def shard_of(self, rank: int) -> int:
        return rank % self.ep


@dataclass
class SubgroupGroups:
    """This rank's process groups: its EP group (with that group's node and rail groups) and its replica
    group."""

    layout: SubgroupLayout
    ep: EPGroups
    replica: dist.ProcessGroup

    @property
    def replica_index(self) -> int:
        """Which copy of its shard this rank holds (0: the first EP group, the one that saves)."""
        return self.layout.block_of(dist.get_rank())


def make_subgroups(layout: SubgroupLayout) -> SubgroupGroups:
    """Create every EP group (with its intra-node and inter-node sub-groups) and every replica group.

    ``new_group`` is collective over the whole world: every rank creates every group, in one order, and
    keeps its own."""
    if not dist.is_available() or not dist.is_initialized():
        raise DSV3Error("expert parallelism needs an initialized torch.distributed process group")
    if dist.get_world_size() != layout.dp:
        raise DSV3Error(f"the layout needs {layout.dp} processes, but {dist.get_world_size()} are running")
    me = dist.get_rank()
    mine: EPGroups | None = None
    for block in range(layout.replicas):
        members = layout.ep_ranks(block)
        groups = ep_groups_of(members, layout.gpus_per_node, dist.new_group(members))
        mine = groups if groups is not None else mine
    replica = None
    for shard in range(layout.ep):
        ranks = layout.replica_ranks(shard)
        g = dist.new_group(ranks)
        replica = g if me in ranks else replica
    return SubgroupGroups(layout, mine, replica)


class SubgroupExpertParallelized(ExpertParallelized):
    """`ExpertParallelized` with the experts split over EP groups of ``layout.ep`` ranks and replicated
    across the ``dp / ep`` groups. Differences from EP over all ranks: the experts' gradients are also
    summed over their replica group, the clipping norm adds expert gradients over one EP group only (each
    expert once), and the parameter count likewise. Expert loads are summed over all ranks (inherited),
    and `full_model` gathers the experts within each EP group: rank 0, which writes checkpoints, takes
    them from replica 0."""

    def _place_experts(self) -> None:
        """This rank's shard of every MoE layer's experts, behind a dispatcher over its EP group."""
        layout = self.layout
        self.groups = make_subgroups(SubgroupLayout(layout.dp, layout.ep, layout.gpus_per_node))
        targets = [m for m in self.model.modules() if isinstance(m, MoE) and isinstance(m.dispatcher,
                                                                                          LocalDispatcher)]
        if not targets:
            raise DSV3Error("the model has no MoE layers to make expert-parallel")
        for moe in targets:
            make_expert_parallel(moe, self.groups.ep, None, layout.dispatch, layout.ep_combine)

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Average gradients as one process would, then clip by the global norm (replicated parameters
        once, each expert once: expert gradients are summed over one EP group, not over the replicas)."""
        sync_grads(self.model)  # dense: mean over all D ranks; experts: EP-group sum / D
        self._sum_over_replicas()
        experts = self.expert_parameter_ids()
        grads = [(p.grad, id(p) in experts) for p in self.model.parameters() if p.grad is not None]
        dense_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if not is_expert), torch.zeros(()))
        expert_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if is_expert), torch.zeros(()))
        device = next(self.model.parameters()).device
        expert_sq = expert_sq.to(device)
        dist.all_reduce(expert_sq, group=self.groups.ep.ep)
        norm = float((dense_sq.to(device) + expert_sq).sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for g, _ in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def _sum_over_replicas(self) -> None:
        """Add the other EP groups' tokens to this shard's expert gradients (one flat all-reduce)."""
        grads = [p.grad for m in ep_layers(self.model) for p in m.experts.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=self.groups.replica)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def parameter_count(self) -> int:
        experts = self.expert_parameter_ids()
        local = sum(p.numel() for p in self.model.parameters() if id(p) in experts)
        dense = sum(p.numel() for p in self.model.parameters() if id(p) not in experts)
        device = next(self.model.parameters()).device
        count = torch.tensor([float(local)], device=device)
        dist.all_reduce(count, group=self.groups.ep.ep)
        return dense + int(count.item())


def expert_replicas_equal(model: nn.Module, groups: SubgroupGroups) -> bool:
    """Whether every replica of this rank's expert shard holds the same weights (a collective over the
    replica group; for the tests: replicas are never re-synchronised, they stay equal by construction)."""
    same = torch.ones(())
    for m in ep_layers(model):
        for p in m.experts.parameters():
            lo, hi = p.detach().float().clone(), p.detach().float().clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=groups.replica)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=groups.replica)
            same = same * float(torch.equal(lo, hi))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())
