"""`parallelize(model, layout)`: apply a layout's parallelism to a plain model and return the one object the
trainer talks to. That object owns what differs between layouts: how the loss module is wrapped, gradient
sync and clipping across the mesh, the expert-load reduction behind the aux-free bias update, the full
model for sampling, sharded checkpoints (DCP), and how many forwards every rank must run in step. The trainer has no
parallelism branches; a single process is the all-ones layout through the same code (its collectives
are no-ops).

Layouts that exist today, over torch.distributed (torchrun; gloo on CPU, NCCL on GPU):

* ``Layout()``: one process.
* ``Layout(dp=D)``: DDP data parallelism over D ranks.
* ``Layout(dp=D, ep=D)``: expert parallelism over the data-parallel ranks (V3: EP borrows them): each rank
  holds D-th of every MoE layer's routed experts behind the two-hop dispatcher, the rest of the model is
  replicated and data parallel.
* ``Layout(dp=D, ep=E)``, E | D, E < D: the same within each block of E consecutive ranks, the experts
  replicated over the D/E blocks (`dsv3.parallel.ep_subgroups`).

* ``Layout(pp=P, dp=D, schedule=S)``: P pipeline stages (dsv3.parallel.pipeline_layout) x D data-parallel
  replicas of the pipeline; with ``ep=E`` (E | D) each stage's routed experts split over E of its D replicas
  (dsv3.parallel.pipeline_ep).

* ``Layout(dp=D, dp_shard="zero1" | "fsdp")``: sharded data parallelism (``dsv3.parallel.sharding``): AdamW
  state, or parameters, gradients and AdamW state, split over the D ranks.
* ``Layout(dp=D, ep=E, dp_shard="zero1" | "fsdp")``: both (``dsv3.parallel.sharded_ep``): the routed experts
  as with EP, everything else sharded over the D ranks.

Pipeline stages with sharding are refused with a clear error until they exist.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dsv3.errors import DSV3Error
from dsv3.model.dispatch import LocalDispatcher
from dsv3.parallel.wire import COMBINE_FORMATS, DISPATCH_FORMATS
from dsv3.precision.logfmt import COMBINE_FORMATS as SIMULATED_COMBINE_FORMATS

SHARDINGS = ("none", "zero1", "fsdp")
COMBINE_FOR_DISPATCH = {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16"}  # V3: FP8 dispatch, BF16 combine


@dataclass(frozen=True)
class Layout:
    """How the processes split the work: ``pp`` pipeline stages x ``dp`` data-parallel ranks (the world),
    ``ep`` of the data-parallel ranks sharing each MoE layer's routed experts, ``dp_shard`` how the
    data-parallel copies are sharded. ``gpus_per_node``, ``dispatch`` and ``combine`` shape the EP
    all-to-all (nodes of the two-hop dispatch, wire formats). ``combine`` None: the dispatch format's
    counterpart under EP (fp8 -> bf16), exact without EP; a format without EP simulates the combine."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    dp_shard: str = "none"
    gpus_per_node: int = 1
    dispatch: str = "fp32"
    combine: str | None = None
    schedule: str = "1f1b"  # the pipeline schedule (pp > 1)
    microbatches: int | None = None  # per pipeline step; None: one per pipeline stage

    @property
    def ep_combine(self) -> str:
        """The EP combine's wire format."""
        return self.combine or COMBINE_FOR_DISPATCH.get(self.dispatch, "bf16")

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def check(self, world_size: int) -> Layout:
        """Itself when it is implemented and fits ``world_size`` processes, else a DSV3Error saying why."""
        for name in ("pp", "dp", "ep", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise DSV3Error(f"layout: {name} must be at least 1, got {getattr(self, name)}")
        if self.pp != 1:
            from dsv3.parallel.pipeline_layout import check_pipeline_layout

            check_pipeline_layout(self)
        if self.dp_shard not in SHARDINGS:
            raise DSV3Error(f"layout: dp_shard must be one of {', '.join(SHARDINGS)}, got {self.dp_shard!r}")
        if self.dp_shard != "none":
            from dsv3.parallel.sharding import check_sharded

            check_sharded(self)
        if self.world != world_size:
            raise DSV3Error(f"the layout needs pp x dp = {self.world} processes, but {world_size} are running")
        if self.ep > 1:
            self._check_ep()
        elif self.combine is not None and self.combine not in SIMULATED_COMBINE_FORMATS:
            raise DSV3Error(
                f"--moe-output-format must be one of "
                f"{', '.join(SIMULATED_COMBINE_FORMATS)}, got {self.combine!r}"
            )
        return self

    def _check_ep(self) -> None:
        if self.dp % self.ep:
            raise DSV3Error(
                f"--ep {self.ep} must divide the number of data-parallel processes ({self.dp}): the experts "
                f"are split over groups of {self.ep} processes and replicated across the groups"
            )
        if self.ep % self.gpus_per_node:
            raise DSV3Error(f"--gpus-per-node {self.gpus_per_node} must divide --ep ({self.ep})")
        if self.dispatch not in DISPATCH_FORMATS or self.ep_combine not in COMBINE_FORMATS:
            raise DSV3Error(
                f"EP wire formats: dispatch must be one of {', '.join(DISPATCH_FORMATS)} and combine one of "
                f"{', '.join(COMBINE_FORMATS)}; got {self.dispatch!r} and {self.ep_combine!r}"
            )


class LossStep(nn.Module):
    """``model.loss`` as a forward, so that DDP's gradient hooks see it; returns detached parts too."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.loss(input_ids, labels)
        zero = out.loss.new_zeros(())
        parts = torch.stack(
            [
                out.loss.detach().float(),
                out.lm_loss.detach().float(),
                (out.mtp_loss if out.mtp_loss is not None else zero).detach().float(),
                (out.balance_loss if out.balance_loss is not None else zero).detach().float(),
            ]
        )
        return out.loss, parts  # parts: [total, lm, mtp, balance]


def parallelize(model: nn.Module, layout: Layout | None = None) -> Parallelized:
    """Apply ``layout`` (default: one process) to ``model`` (a `Transformer`, the same on every rank: same
    seed or checkpoint) in place and return the object that trains it. Every rank must call it."""
    layout = (layout or Layout()).check(_world_size())
    if layout.pp > 1 and layout.dp_shard == "zero1":
        from dsv3.parallel.pipeline_zero1 import pipeline_zero1

        return pipeline_zero1(model, layout)
    if layout.pp > 1 and layout.ep > 1:
        from dsv3.parallel.pipeline_ep import PipelineExpertParallelized

        return PipelineExpertParallelized(model, layout)
    if layout.pp > 1:
        from dsv3.parallel.pipeline_layout import PipelineParallelized

        return PipelineParallelized(model, layout)
    if layout.ep > 1 and layout.dp_shard != "none":
        from dsv3.parallel.sharded_ep import sharded_expert_parallel

        return sharded_expert_parallel(model, layout)
    if layout.ep > 1 and layout.ep < layout.dp:
        from dsv3.parallel.ep_subgroups import SubgroupExpertParallelized

        return SubgroupExpertParallelized(model, layout)
    if layout.ep > 1:
        return ExpertParallelized(model, layout)
    if layout.dp_shard != "none":
        from dsv3.parallel.sharding import sharded

        return sharded(model, layout)
    return Parallelized(model, layout)


def equal_share(windows: list[int], world: int) -> list[int]:
    """Evaluation windows that split evenly over ``world`` ranks, for layouts whose every forward is a
    collective: the first multiple-of-``world`` windows, or with fewer windows than ranks every window
    repeated alike (the same mean loss; a rank left without a window would hang the others)."""
    if len(windows) >= world:
        return windows[: len(windows) // world * world]
    return windows * (world // math.gcd(len(windows), world)) if windows else windows


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Parallelized:
    """A model under a replicated layout: one process, or DDP over the data-parallel ranks (gradients
    averaged by DDP's hooks during backward). Subclasses change what their layout changes."""

    def __init__(self, model: nn.Module, layout: Layout):
        self.model, self.layout = model, layout
        self.world = layout.world
        self._place_experts()
        self.module = self._wrap(LossStep(model))

    def _place_experts(self) -> None:
        """Every expert stays in every process; a combine format is simulated by the local dispatchers."""
        if self.layout.combine is not None:
            for d in self.model.modules():
                if isinstance(d, LocalDispatcher):
                    d.combine_format = self.layout.combine

    def _wrap(self, step: LossStep) -> nn.Module:
        """LossStep, inside DDP when there are several ranks. Buffers are not broadcast: each rank counts
        its own expert loads, and the router biases stay equal because every rank applies one update."""
        if self.world == 1:
            return step
        device = next(self.model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(step, device_ids=device_ids, broadcast_buffers=False)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, detached [total, lm, mtp, balance]) of this rank's micro-batch."""
        return self.module(input_ids, labels)

    @property
    def data_size(self) -> int:
        """How many data-parallel ranks split each global batch."""
        return self.layout.dp

    @property
    def data_rank(self) -> int:
        """This process's index among the data-parallel ranks (its slice of every global batch)."""
        return dist.get_rank() if self.world > 1 else 0

    def check_batch(self, per_rank: int) -> None:
        """Refuse a per-rank micro-batch size the layout cannot run (any size works here)."""

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast,
                         grad_accum: int) -> list[float]:
        """Backward of the mean loss over the global batch (this rank's ``batches``, one per micro-step:
        (input_ids, labels) on the model's device); returns its [total, lm, mtp, balance] averaged over
        the micro-steps and the data-parallel ranks."""
        sums = torch.zeros(4, dtype=torch.float64)
        for j, (inputs, labels) in enumerate(batches):
            last = j == len(batches) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                with autocast:
                    loss, parts = self(inputs, labels)
                (loss / grad_accum).backward()
            sums += parts.double().cpu()
        device = next(self.model.parameters()).device
        total = self.sum_(sums.to(device)).cpu() / (self.data_size * grad_accum)
        return total.tolist()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for a micro-batch that is not the step's last: its backward skips the gradient sync."""
        return self.module.no_sync() if isinstance(self.module, DistributedDataParallel) else contextlib.nullcontext()

    def sync_and_clip(self, max_norm: float) -> float:
        """Finish the gradient sync, clip by the global norm; returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) over the data-parallel ranks, in place; returns t."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def reduce_expert_loads(self) -> None:
        """Sum every MoE layer's token counts over the data-parallel ranks, so that every rank applies the
        same aux-free bias update, the one a single process would."""
        for moe in self.model.moe_layers():
            self.sum_(moe.expert_load)

    def expert_loads(self) -> list[list[int]]:
        """Every MoE layer's token counts (after `reduce_expert_loads`), in the whole model's layer order."""
        return [[int(x) for x in moe.expert_load.tolist()] for moe in self.model.moe_layers()]

    def update_router_biases(self) -> list[float]:
        """The aux-free bias update of every MoE layer held here; returns the whole model's max/mean loads."""
        return self.model.update_router_biases()

    def full_model(self) -> nn.Module:
        """The whole model on every rank (a collective), for sampling: here the model itself."""
        return self.model

    def eval_model(self) -> nn.Module:
        """A model whose forward gives logits, for held-out evaluation on every rank (a collective)."""
        return self.model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once with the optimizer built over ``model.parameters()``: a sharded layout hooks its step."""

    def updated_parameters(self) -> list[nn.Parameter]:
        """The parameters whose optimizer state this rank keeps (ZeRO-1: only those it owns)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def save_state(self, folder, optimizer: torch.optim.Optimizer) -> None:
        """Write this rank's share of the model and optimizer state into the DCP checkpoint ``folder``, keyed
        by the whole model's names (`dsv3.parallel.checkpoint`); a collective over every rank."""
        from dsv3.parallel.checkpoint import save_state

        save_state(folder, self.model, optimizer)

    def load_state(self, folder, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's share from a DCP checkpoint that any layout wrote (resharding); a collective."""
        from dsv3.parallel.checkpoint import load_state

        load_state(folder, self.model, optimizer, self.updated_parameters())

    def parameter_count(self) -> int:
        """Parameters of the whole model, however they are spread over ranks."""
        return sum(p.numel() for p in self.model.parameters())

    def windows_for_eval(self, windows: list[int]) -> list[int]:
        """The evaluation windows to use: all of them (ranks need not run the same number of forwards)."""
        return windows

    def checkpoint_fields(self) -> dict:
        """What a checkpoint records about the layout (a resume checks it)."""
        return {"world_size": self.world, "ep_size": self.layout.ep if self.layout.ep > 1 else 0,
                "layout": asdict(self.layout)}


class ExpertParallelized(Parallelized):
    """Expert parallelism over the data-parallel ranks: each rank holds its share of every MoE layer's
    routed experts. No DDP: `sync_grads` averages the replicated gradients and scales the experts' after
    backward; the norm for clipping adds every rank's expert gradients; `full_model` gathers all experts into
    one ordinary model (for sampling), while a checkpoint holds each expert under its own key; every MoE
    forward is a collective, so all ranks evaluate the same number of batches."""

    def _place_experts(self) -> None:
        """This rank's share of every MoE layer's experts, behind the two-hop dispatcher."""
        from dsv3.parallel.ep import apply_expert_parallel

        layout = self.layout
        apply_expert_parallel(self.model, layout.gpus_per_node, dispatch=layout.dispatch, combine=layout.ep_combine)

    def _wrap(self, step: LossStep) -> nn.Module:
        return step

    def expert_parameter_ids(self) -> set[int]:
        from dsv3.parallel.ep import ep_layers

        return {id(p) for m in ep_layers(self.model) for p in m.experts.parameters()}

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Average gradients the EP way, then clip by the global norm (replicated parameters counted once,
        each rank's experts added over ranks)."""
        from dsv3.parallel.ep import sync_grads

        sync_grads(self.model)
        experts = self.expert_parameter_ids()
        grads = [(p.grad, id(p) in experts) for p in self.model.parameters() if p.grad is not None]
        dense_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if not is_expert), torch.zeros(()))
        expert_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if is_expert), torch.zeros(()))
        device = next(self.model.parameters()).device
        total_sq = dense_sq.to(device) + self.sum_(expert_sq.to(device))
        norm = float(total_sq.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for g, _ in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """A single-process `Transformer` with every expert, built on every rank (all ranks must call it).
        Shares the replicated tensors with the model."""
        from dsv3.model.transformer import Transformer
        from dsv3.parallel.ep import ep_layers, logical_expert_weights

        names = {id(m): name for name, m in self.model.named_modules()}
        state = self.model.state_dict()
        for moe in ep_layers(self.model):
            for pname, full in logical_expert_weights(moe).items():
                state[f"{names[id(moe)]}.experts.{pname}"] = full
        with torch.device("meta"):
            full_model = Transformer(self.model.config)
        full_model.load_state_dict(state, strict=True, assign=True)
        full_model.init_buffers(next(self.model.parameters()).device)
        return full_model.train(self.model.training)

    def parameter_count(self) -> int:
        experts = self.expert_parameter_ids()
        local = sum(p.numel() for p in self.model.parameters() if id(p) in experts)
        dense = sum(p.numel() for p in self.model.parameters() if id(p) not in experts)
        device = next(self.model.parameters()).device
        return dense + int(self.sum_(torch.tensor([float(local)], device=device)).item())

    def windows_for_eval(self, windows: list[int]) -> list[int]:
        """Every forward is a collective here, so every rank must run as many (`equal_share`)."""
        return equal_share(windows, self.world)
