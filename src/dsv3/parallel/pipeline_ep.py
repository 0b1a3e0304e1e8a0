"""Pipeline stages x expert parallelism (``Layout(pp=P, dp=D, ep=E, schedule=S)``, E | D): V3's own shape
(PP16 x EP64 over the data-parallel ranks), on `torch.distributed.pipelining`.

Ranks: process ``p * D + d`` is pipeline rank ``p`` of data-parallel replica ``d`` (stage-major, unlike plain
pipeline x data parallelism: a stage's replicas are consecutive processes, so an EP group of consecutive
replicas fills whole nodes, as the two-hop dispatch assumes). The D replicas of a stage form its
data-parallel group; inside it the routed experts of every MoE layer the stage holds are split over blocks of
E consecutive replicas (the EP groups, `SubgroupLayout`'s arithmetic on the replica index) and replicated
across the D/E blocks (the expert-replica groups). Every MoE forward and
backward is a collective of its EP group: all ranks of a stage run the same schedule, hence the same
micro-batches in the same order.

Each of a rank's stages (two under the V schedules) gets EP groups of its own, so that DualPipeV's
overlapped step can run one stage's forward and the other stage's backward at once (two threads, two
communicators; `pipeline_overlap.run_concurrently`): one micro-batch's dispatch/combine in flight while the
other micro-batch computes.

Gradients, for the single-process step's loss (every micro-batch weighted by its share of the global batch,
so gradients add up): replicated parameters are summed over the stage's D replicas; an expert's gradient
already holds its EP group's tokens (the dispatcher's backward), and the sum over its D/E replicas adds the
rest. Clipping uses the global norm: replicated parameters once per stage, each expert once (summed over one
EP group), every stage (over the pipeline). Expert loads are summed over all D replicas of the stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.model.moe import MoE
from dsv3.parallel.ep import ep_layers, logical_expert_weights, make_expert_parallel
from dsv3.parallel.ep_groups import EPGroups, ep_groups_of
from dsv3.parallel.ep_subgroups import SubgroupLayout
from dsv3.parallel.layout import Layout
from dsv3.parallel.pipeline_layout import PipelineParallelized, process_rank
from dsv3.parallel.pipeline_overlap import Overlap, run_concurrently


def ep_group_ranks(layout: Layout, pp_rank: int, block: int) -> list[int]:
    """Global ranks of EP group ``block`` of pipeline rank ``pp_rank``'s stages, in EP-rank order
    (consecutive processes: whole nodes)."""
    sub = SubgroupLayout(layout.dp, layout.ep, layout.gpus_per_node)
    return [process_rank(layout, d, pp_rank, stage_major=True) for d in sub.ep_ranks(block)]


def replica_group_ranks(layout: Layout, pp_rank: int, shard: int) -> list[int]:
    """Global ranks holding expert shard ``shard`` of pipeline rank ``pp_rank``'s stages (one per EP group)."""
    sub = SubgroupLayout(layout.dp, layout.ep, layout.gpus_per_node)
    return [process_rank(layout, d, pp_rank, stage_major=True) for d in sub.replica_ranks(shard)]


def _make_groups(layout: Layout, slots: int) -> tuple[list[EPGroups], dist.ProcessGroup | None]:
    """This rank's EP groups, one per stage slot (its k-th stage), and its expert-replica group (None with one
    EP group per stage). Every rank creates every group in one order, as ``new_group`` requires."""
    me = dist.get_rank()
    mine: list[EPGroups] = []
    for _ in range(slots):
        for p in range(layout.pp):
            for block in range(layout.dp // layout.ep):
                members = ep_group_ranks(layout, p, block)
                groups = ep_groups_of(members, layout.gpus_per_node, dist.new_group(members))
                if groups is not None:
                    mine.append(groups)
    replica = None
    if layout.dp > layout.ep:
        for p in range(layout.pp):
            for shard in range(layout.ep):
                ranks = replica_group_ranks(layout, p, shard)
                group = dist.new_group(ranks)
                replica = group if me in ranks else replica
    return mine, replica


class PipelineExpertParallelized(PipelineParallelized):
    """`PipelineParallelized` whose stages' routed experts are split over EP groups of ``layout.ep`` of the
    stage's data-parallel replicas. ``overlap``: how DualPipeV runs its OVERLAP_F_B pairs (default:
    concurrently, V3's overlap; `run_in_order` is the reference). Processes are stage-major: a stage's
    D replicas are consecutive, so its EP groups fill whole nodes (V3: a stage is 16 nodes, 2 EP groups)."""

    stage_major = True

    def __init__(self, model: nn.Module, layout: Layout, overlap: Overlap | None = None):
        if not any(isinstance(m, MoE) for m in model.modules()):
            raise DSV3Error("--ep: the model has no MoE layers to make expert-parallel")
        if layout.schedule == "dualpipev" and overlap is None:
            overlap = run_concurrently
        super().__init__(model, layout, overlap=overlap if layout.schedule == "dualpipev" else None)
        self.ep_groups, self.replica_group = _make_groups(layout, len(self.pipe.stage_modules))
        for stage, groups in zip(self.pipe.stage_modules, self.ep_groups, strict=True):
            for moe in (m for m in stage.modules() if isinstance(m, MoE)):
                make_expert_parallel(moe, groups, None, layout.dispatch, layout.ep_combine)

    def expert_parameter_ids(self) -> set[int]:
        return {id(p) for m in ep_layers(self.model) for p in m.experts.parameters()}

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """One EP group of this rank's stages (all its stages' EP groups have the same members)."""
        return self.ep_groups[0].ep

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Replicated gradients summed over the stage's replicas, experts over their replicas, tied copies
        summed; then clipping by the global norm (each parameter once over the whole layout)."""
        pipe = self.pipe
        params = pipe.parameters()
        experts = self.expert_parameter_ids()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _flat_sum([p.grad for p in params if id(p) not in experts], self.dp_group)
        if self.replica_group is not None:
            _flat_sum([p.grad for p in params if id(p) in experts], self.replica_group)
        pipe.sum_tied()
        zero = torch.zeros((), device=pipe.device)
        counted = list(pipe.counted_once(params))
        dense = sum((p.grad.float().pow(2).sum() for p in counted if id(p) not in experts), zero)
        expert = sum((p.grad.float().pow(2).sum() for p in counted if id(p) in experts), zero.clone())
        dist.all_reduce(expert, group=self.ep_group)
        return pipe.clip(params, dense + expert, max_norm)

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' state with every expert of their MoE layers (gathered over the EP group)."""
        names = {id(m): name for name, m in self.model.named_modules()}
        state = dict(self.model.state_dict())
        for moe in ep_layers(self.model):
            for pname, full in logical_expert_weights(moe).items():
                state[f"{names[id(moe)]}.experts.{pname}"] = full
        return state

    def parameter_count(self) -> int:
        """The whole model's parameters: replicated ones once per stage, experts once per EP group."""
        experts = self.expert_parameter_ids()
        counted = list(self.pipe.counted_once(self.pipe.parameters()))
        device = self.pipe.device
        local = torch.tensor(float(sum(p.numel() for p in counted if id(p) in experts)), dtype=torch.float64,
                             device=device)
        dist.all_reduce(local, group=self.ep_group)
        local += float(sum(p.numel() for p in counted if id(p) not in experts))
        dist.all_reduce(local, group=self.pp_group)
        return int(local)

    def checkpoint_fields(self) -> dict:
        return super().checkpoint_fields() | {"ep_size": self.layout.ep}


def _flat_sum(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """All-reduce (sum) the gradients ``grads`` over ``group`` as one flat buffer."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
