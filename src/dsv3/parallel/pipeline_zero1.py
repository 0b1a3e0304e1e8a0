"""Pipeline stages x ZeRO-1 data parallelism: ``Layout(pp=P, dp=D, dp_shard="zero1")``, with or without
``ep=E`` inside the stages: V3's own layout (PP16 x EP64 x ZeRO-1 over the data-parallel ranks).

Within each stage, the D replicas share the work of the optimizer instead of repeating it: each replicated
parameter of the stage has one owner among them (`OwnerSharding` over the stage's data-parallel group),
which alone receives the gradient summed over the replicas, keeps AdamW state and steps, then broadcasts
the updated tensor. With EP, each routed-expert tensor has one owner among the stage's replicas holding the
same expert shard (the expert-replica group), as in `Zero1ExpertParallelized`.

The divisor is 1, not D: the pipeline weights every micro-batch's loss by its share of the global batch, so
gradients add up over replicas (`PipelineParallel.sync_and_clip` sums them too). The tied embedding (its
copies on the first and the last stage under 1F1B and interleaved 1F1B) is summed between the two ends of
each replica's pipeline BEFORE the owners' reduce, so both ends' owners receive the whole model's gradient,
take the same AdamW step and keep the copies equal. The clipping norm adds every rank's owned gradients
over the world: each replicated tensor has one owner per stage, each expert tensor one per shard, and the
last stage's tied copy is left out (`counted_once`), so every parameter of the model counts once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsv3.parallel.ep_subgroups import SubgroupLayout
from dsv3.parallel.layout import Layout, Parallelized
from dsv3.parallel.pipeline_ep import PipelineExpertParallelized, replica_group_ranks
from dsv3.parallel.pipeline_layout import PipelineParallelized, process_rank
from dsv3.parallel.sharding import OwnerSharding, clip_scale


def pipeline_zero1(model: nn.Module, layout: Layout) -> Parallelized:
    """The Parallelized object of a pipeline layout with ``dp_shard="zero1"`` (with or without EP)."""
    return (PipelineExpertZero1 if layout.ep > 1 else PipelineZero1)(model, layout)


class _Zero1Stages:
    """ZeRO-1 over each stage's replicas, on top of a `PipelineParallelized` (mixed in before it)."""

    pipe: object
    layout: Layout
    dp_group: dist.ProcessGroup | None

    def _shard(self, experts: set[int], expert_ranks: list[int], expert_group: dist.ProcessGroup | None) -> None:
        """Owners for this rank's replicated parameters (among the stage's D replicas) and its routed-expert
        parameters with ids ``experts`` (among ``expert_ranks``, global ranks of ``expert_group``)."""
        params = self.pipe.parameters()
        stage_ranks = [process_rank(self.layout, d, self.pipe.pp_rank, self.stage_major) for d in range(self.layout.dp)]
        self.dense = OwnerSharding([p for p in params if id(p) not in experts], stage_ranks, self.dp_group, 1)
        self.experts = OwnerSharding([p for p in params if id(p) in experts], expert_ranks, expert_group, 1)

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and keeps AdamW state for)."""
        return self.dense.owned() + self.experts.owned()

    def updated_parameters(self) -> list[nn.Parameter]:
        """A resumed rank loads optimizer state for the parameters it owns only."""
        return self.owned()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step the owners share their updated parameters with the stage's replicas."""
        optimizer.register_step_post_hook(lambda *_: self._broadcast_updates())

    def _broadcast_updates(self) -> None:
        self.dense.broadcast_updates()
        self.experts.broadcast_updates()

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Tied copies summed between the pipeline's ends, then every gradient summed onto its owner (zeros
        where a rank computed none, as the unsharded pipeline does); clipping by the global norm."""
        pipe = self.pipe
        for p in pipe.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pipe.sum_tied()
        self.dense.reduce_grads()
        self.experts.reduce_grads()
        owned = [p for p in pipe.counted_once(self.owned()) if p.grad is not None]
        square = sum((p.grad.double().pow(2).sum() for p in owned), torch.zeros((), dtype=torch.float64,
                                                                                 device=pipe.device))
        dist.all_reduce(square)  # the world: every stage, every replica
        norm = float(square.sqrt())
        if (factor := clip_scale(norm, max_norm)) is not None:
            self.dense.scale_owned_grads(factor)
            self.experts.scale_owned_grads(factor)
        return norm


class PipelineZero1(_Zero1Stages, PipelineParallelized):
    """`PipelineParallelized` whose stages' replicas each own 1/D of the stage's parameters (ZeRO-1)."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        self._shard(set(), [self.rank], None)


class PipelineExpertZero1(_Zero1Stages, PipelineExpertParallelized):
    """`PipelineExpertParallelized` with ZeRO-1: replicated parameters owned among the stage's D replicas,
    each expert tensor among the replicas of its expert shard."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        sub = SubgroupLayout(layout.dp, layout.ep, layout.gpus_per_node)
        ranks = replica_group_ranks(layout, self.pipe.pp_rank, sub.shard_of(self.data_rank))
        self._shard(self.expert_parameter_ids(), ranks, self.replica_group)
