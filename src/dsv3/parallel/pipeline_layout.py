"""``Layout(pp=P, dp=D)`` for the trainer: `PipelineParallelized` runs every optimizer step through E's
`PipelineParallel` schedule and gives the trainer the same object every other layout gives it.

Ranks: process ``r`` is pipeline rank ``r % P`` of data-parallel replica ``r // P`` (a replica's stages sit
on consecutive processes); with EP inside the stages the order is stage-major (`process_rank`). Each process
holds only its stages' modules, so what needs the whole model (sampling, held-out evaluation) gathers the
stages' tensors into one ordinary
`Transformer` on every process of the pipeline: simple and exact, and cheap at the sizes a CPU trains.
Each process keeps the optimizer state of its own parameters; a checkpoint holds each stage's tensors under
the whole model's names (`dsv3.parallel.checkpoint`), so a pipeline run resumes under any layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.parallel.layout import Layout, Parallelized
from dsv3.parallel.pipeline import SCHEDULES, Elsewhere, PipelineParallel, plan_pipeline
from dsv3.parallel.pipeline_overlap import Overlap

STAGES_PER_RANK = {"1f1b": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2}


def check_pipeline_layout(layout: Layout) -> None:
    """What a pipeline layout may combine with today (a DSV3Error for the rest)."""
    if layout.schedule not in SCHEDULES:
        raise DSV3Error(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {layout.schedule!r}")
    if layout.microbatches is not None and layout.microbatches < 1:
        raise DSV3Error(f"--micro-batches must be at least 1, got {layout.microbatches}")
    if layout.ep > 1 and layout.dp % layout.ep:
        raise DSV3Error(f"--ep {layout.ep} must divide the {layout.dp} data-parallel replica(s) of each pipeline "
                        f"stage (processes / --pp {layout.pp}): a stage's routed experts are split over --ep of them")
    if layout.dp_shard == "fsdp":  # zero1: dsv3.parallel.pipeline_zero1
        raise DSV3Error(f"--pp {layout.pp} with --dp-shard fsdp: pipeline stages with FSDP are not implemented; "
                        "use --dp-shard zero1")
    if layout.dp_shard == "zero1" and layout.dp < 2:
        raise DSV3Error(f"--pp {layout.pp} with --dp-shard zero1 shards each stage over its data-parallel replicas, "
                        f"but there is one; start a multiple of {layout.pp} processes, at least {2 * layout.pp}")


def default_microbatches(layout: Layout) -> int:
    """One micro-batch per pipeline stage: the fewest that every schedule accepts."""
    return layout.microbatches or layout.pp * STAGES_PER_RANK[layout.schedule]


def process_rank(layout: Layout, replica: int, pp_rank: int, stage_major: bool = False) -> int:
    """The process of pipeline rank ``pp_rank`` in data-parallel replica ``replica``: replica-major
    (``replica * P + pp_rank``: a replica's stages on consecutive processes) or stage-major (``pp_rank * D +
    replica``: a stage's replicas on consecutive processes, so that its EP groups fill whole nodes)."""
    return pp_rank * layout.dp + replica if stage_major else replica * layout.pp + pp_rank


def _groups(layout: Layout, stage_major: bool = False) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this process's pipeline group, its data-parallel group); every process creates every group, in the
    same order, as ``new_group`` requires. One replica: the world is the pipeline, no data-parallel group."""
    P, D = layout.pp, layout.dp
    if D == 1:
        return None, None
    rank = dist.get_rank()
    pp_group = dp_group = None
    for d in range(D):
        ranks = [process_rank(layout, d, p, stage_major) for p in range(P)]
        group = dist.new_group(ranks)
        pp_group = group if rank in ranks else pp_group
    for p in range(P):
        ranks = [process_rank(layout, d, p, stage_major) for d in range(D)]
        group = dist.new_group(ranks)
        dp_group = group if rank in ranks else dp_group
    return pp_group, dp_group


class PipelineParallelized(Parallelized):
    """A `Transformer` in P pipeline stages (schedule ``layout.schedule``, ``layout.microbatches``
    micro-batches per step) times D data-parallel replicas. ``model`` keeps only this process's modules."""

    stage_major = False  # process order (`process_rank`): replica-major here

    def __init__(self, model: nn.Module, layout: Layout, overlap: Overlap | None = None):
        # no super().__init__: no LossStep, no DDP. overlap: how DualPipeV runs its OVERLAP_F_B pairs.
        self.model, self.layout, self.world = model, layout, layout.world
        self.rank = dist.get_rank()
        plan = plan_pipeline(model.config, layout.pp, layout.schedule, default_microbatches(layout))
        self.pp_group, self.dp_group = _groups(layout, self.stage_major)
        self.pipe = PipelineParallel(model, plan, pp_group=self.pp_group, dp_group=self.dp_group, overlap=overlap)
        self.module = None

    @property
    def plan(self):
        return self.pipe.plan

    @property
    def data_rank(self) -> int:
        return self.rank % self.layout.dp if self.stage_major else self.rank // self.layout.pp

    def check_batch(self, per_rank: int) -> None:
        M = self.plan.microbatches
        if per_rank % M:
            raise DSV3Error(
                f"each data-parallel replica gets {per_rank} sequences per micro-step (--batch-size / "
                f"(replicas x --grad-accum)), which does not split into --micro-batches {M}; make it a multiple"
            )

    # ---- one step -------------------------------------------------------------------------------
    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast,
                         grad_accum: int) -> list[float]:
        """One pipeline schedule per micro-step (each normalised by its own global token counts, so its
        gradient is that micro-step's mean loss), then gradients scaled by 1/grad_accum: the trainer's
        mean over micro-steps. Returns the global parts averaged over micro-steps, on every rank."""
        sums = torch.zeros(4, dtype=torch.float64)
        for inputs, labels in batches:
            with autocast:
                sums += torch.tensor(self.pipe.forward_backward(inputs, labels), dtype=torch.float64)
        if grad_accum > 1:
            with torch.no_grad():
                for p in self.pipe.parameters():
                    if p.grad is not None:
                        p.grad.div_(grad_accum)
        return (sums / grad_accum).tolist()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        raise DSV3Error("a pipeline-parallel model runs whole steps: call forward_backward")

    def sync_and_clip(self, max_norm: float) -> float:
        return self.pipe.sync_and_clip(max_norm)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) over the data-parallel replicas, in place; returns t."""
        return self.pipe._dp_sum(t)

    def reduce_expert_loads(self) -> None:
        self.pipe.reduce_expert_loads()

    def expert_loads(self) -> list[list[int]]:
        """Every MoE layer's counts, gathered from the pipeline's ranks, in the whole model's layer order."""
        return self._gather_by_layer(super().expert_loads())

    def update_router_biases(self) -> list[float]:
        return self._gather_by_layer(self.model.update_router_biases())

    def _gather_by_layer(self, values: list) -> list:
        """``values`` (one per MoE layer held here, in ``model.moe_layers()`` order) from every pipeline
        rank, merged in layer order."""
        mine = list(zip(self._moe_layer_indices(), values, strict=True))
        gathered: list = [None] * self.layout.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return [v for _, v in sorted(pair for part in gathered for pair in part)]

    def _moe_layer_indices(self) -> list[tuple[int, int]]:
        """(layer index, MoE index inside it) of every MoE module held here, in ``moe_layers()`` order."""
        from dsv3.model.moe import MoE

        where = {}
        for i, layer in enumerate(self.model.model.layers):
            if not isinstance(layer, Elsewhere):
                for j, m in enumerate(x for x in layer.modules() if isinstance(x, MoE)):
                    where[id(m)] = (i, j)
        return [where[id(m)] for m in self.model.moe_layers()]

    # ---- the whole model ------------------------------------------------------------------------
    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """An ordinary single-process `Transformer` with every stage's tensors, built on every process (all
        must call it): each pipeline rank's state dict is gathered over its pipeline and merged (the
        tied embedding's copies are equal, since `sync_and_clip` gives them one gradient)."""
        from dsv3.model.transformer import Transformer

        device = next(self.model.parameters()).device
        mine = {k: v.detach().cpu() for k, v in self.local_state().items()}
        gathered: list = [None] * self.layout.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        state = {}
        for part in gathered:
            state.update(part)
        with torch.device("meta"):
            full = Transformer(self.model.config)
        full.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
        full.init_buffers(device)
        return full.train(self.model.training)

    def local_state(self) -> dict[str, torch.Tensor]:
        """This process's share of the whole model's state dict, by the whole model's names."""
        return self.model.state_dict()

    def eval_model(self) -> nn.Module:
        """The gathered whole model: every process evaluates its share of the windows on it."""
        return self.full_model()

    def parameter_count(self) -> int:
        return self.pipe.parameter_count()

    def checkpoint_fields(self) -> dict:
        return {"world_size": self.world, "ep_size": 0, "layout": asdict(self.layout)}
