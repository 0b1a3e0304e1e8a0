"""Sharded data parallelism with expert parallelism: ``Layout(dp=D, ep=E, dp_shard="fsdp" | "zero1")``, E | D.

As in V3, EP borrows the data-parallel ranks. The routed experts are placed as by EP over part of the ranks
(`dsv3.parallel.ep_subgroups`; E = D is the case of one EP group): EP groups of E consecutive ranks each
hold every routed expert once, and the D/E ranks holding the same expert shard form a replica group.
Everything else (attention, dense layers, shared experts, router, embedding, head, MTP) is sharded over
all D ranks:

* ``fsdp``: FSDP2 (`fully_shard`) on every Block and the root with the routed experts as ignored
  parameters, so the non-expert parameters, gradients and AdamW state are DTensor shards (1/D each) under
  the full model's FQNs, while each rank's local experts stay plain tensors (their AdamW state is kept on
  every replica).
* ``zero1``: ZeRO-1 (`OwnerSharding`): each non-expert parameter has one owner among the D ranks, each
  expert tensor one owner among its replica group; owners alone keep AdamW state and update, then
  broadcast. With E = D the replica groups are single ranks, so every rank owns its own experts.

Gradients equal the single-process step's (the mean loss over all D ranks' tokens): the non-expert ones
are averaged over D (FSDP's reduce-scatter, or the owners' reduce); the experts', which the dispatcher's
backward has summed over the tokens of the EP group, are summed over the replica group and divided by D.
The clipping norm counts every parameter once: the non-expert shards over all D ranks, the experts over
one EP group (fsdp), or the owned tensors over all ranks (zero1: each expert tensor has one owner among
its replicas). Expert loads are summed over all D ranks (`Parallelized.reduce_expert_loads`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from dsv3.parallel.ep import ep_layers, logical_expert_weights
from dsv3.parallel.ep_subgroups import SubgroupExpertParallelized
from dsv3.parallel.layout import Layout, LossStep, Parallelized
from dsv3.parallel.memory import local_tensor
from dsv3.parallel.sharding import (
    OwnerSharding,
    clip_scale,
    fsdp_no_sync,
    plain_model,
    shard_model,
)


def sharded_expert_parallel(model: nn.Module, layout: Layout) -> Parallelized:
    """The Parallelized object of ``layout`` (EP with ``dp_shard`` zero1 or fsdp)."""
    return (Zero1ExpertParallelized if layout.dp_shard == "zero1" else FSDPExpertParallelized)(model, layout)


class _ShardedExpertParallelized(SubgroupExpertParallelized):
    """What both shardings share: the experts' placement over EP groups and replica groups (inherited),
    the experts' gradient averaging, and saving with every expert gathered into one plain model."""

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's routed-expert parameters, in model order (the same shapes on every rank)."""
        return [p for m in ep_layers(self.model) for p in m.experts.parameters() if p.requires_grad]

    def non_expert_parameters(self) -> list[nn.Parameter]:
        experts = self.expert_parameter_ids()
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in experts]

    @torch.no_grad()
    def _average_expert_grads(self) -> None:
        """The experts' gradients as one process's mean: the EP group's sum (from the dispatcher's backward)
        summed over the replica group, divided by D. A rank whose experts got no token has zeros."""
        grads = []
        for p in self.expert_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.groups.layout.replicas > 1:
            dist.all_reduce(flat, group=self.groups.replica)
        flat /= self.world
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """A plain single-process `Transformer` with every expert, on every rank (a collective): sharded
        tensors all-gathered, each MoE layer's experts gathered over its EP group."""
        names = {id(m): name for name, m in self.model.named_modules()}
        state = {name: _full(t) for name, t in self.model.state_dict().items()}
        for moe in ep_layers(self.model):
            for pname, full in logical_expert_weights(moe).items():
                state[f"{names[id(moe)]}.experts.{pname}"] = full
        return plain_model(self.model, state)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); any other tensor itself."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


class FSDPExpertParallelized(_ShardedExpertParallelized):
    """FSDP2 over all D ranks for everything but the routed experts, which are expert parallel."""

    def _wrap(self, step: LossStep) -> nn.Module:
        shard_model(self.model, ignored=set(self.expert_parameters()))
        return step

    def no_sync(self) -> contextlib.AbstractContextManager:
        return fsdp_no_sync(self.model)

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Experts averaged; the norm adds the non-expert shards over all ranks and the experts over one EP
        group (each expert once)."""
        self._average_expert_grads()
        dense = [local_tensor(p.grad) for p in self.non_expert_parameters() if p.grad is not None]
        experts = [p.grad for p in self.expert_parameters()]
        device = next(self.model.parameters()).device
        dense_sq = self.sum_(sum((g.float().pow(2).sum() for g in dense), torch.zeros((), device=device)))
        expert_sq = sum((g.float().pow(2).sum() for g in experts), torch.zeros((), device=device))
        dist.all_reduce(expert_sq, group=self.groups.ep.ep)
        norm = float((dense_sq + expert_sq).sqrt())
        if (factor := clip_scale(norm, max_norm)) is not None:
            for g in dense + experts:
                g.mul_(factor)
        return norm


class Zero1ExpertParallelized(_ShardedExpertParallelized):
    """ZeRO-1 for the non-expert parameters over all D ranks, and for each rank's experts over its replica
    group: AdamW state exists once per parameter over the whole world."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        me, world = dist.get_rank(), self.world
        self.dense = OwnerSharding(self.non_expert_parameters(), list(range(world)), None, world)
        replica_ranks = self.groups.layout.replica_ranks(self.groups.layout.shard_of(me))
        self.experts = OwnerSharding(self.expert_parameters(), replica_ranks, self.groups.replica, world)

    def _wrap(self, step: LossStep) -> nn.Module:
        return step

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step the owners share their updated parameters."""
        optimizer.register_step_post_hook(lambda *_: self._broadcast_updates())

    def updated_parameters(self) -> list[nn.Parameter]:
        """A resumed rank loads optimizer state for the parameters it owns only."""
        return self.dense.owned() + self.experts.owned()

    def _broadcast_updates(self) -> None:
        self.dense.broadcast_updates()
        self.experts.broadcast_updates()

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Non-expert gradients averaged onto their owners, expert gradients (zeros where no token came)
        summed over the replica group onto theirs and divided by D; the norm adds every rank's owned ones."""
        self.dense.reduce_grads()
        for p in self.expert_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.experts.reduce_grads()
        norm = float(self.sum_(self.dense.owned_grad_square_sum() + self.experts.owned_grad_square_sum()).sqrt())
        if (factor := clip_scale(norm, max_norm)) is not None:
            self.dense.scale_owned_grads(factor)
            self.experts.scale_owned_grads(factor)
        return norm
