"""Pipeline parallelism for the `Transformer` on `torch.distributed.pipelining`: stages, schedules
(1F1B, interleaved 1F1B, ZBV zero-bubble, DualPipeV) and the training step around them.

A full model is built the same way on every rank (same seed or checkpoint); `PipelineParallel` splits
it into `PipelineStage`s and drops the layers that other ranks own. The first stage holds the embedding
and the first layers; the last stage holds the final norm, the output head, the MTP layer(s) and the
loss. The MTP layers read the embedding too: under the V-shaped schedules (ZBV, DualPipeV) the first and
the last stage sit on one rank and share the very same Parameter; under 1F1B and interleaved 1F1B the
last stage's rank keeps its own copy, and `sync_and_clip` sums the copies' gradients (Megatron's rule for
tied embeddings) so that both apply one update and stay equal.

Every micro-batch's loss is weighted by its share of the global batch (labelled tokens for the LM and MTP
terms, sequences for the balance loss), so the sum over micro-batches and data-parallel ranks is the
single-process `Transformer.loss` of the whole batch, and gradients are summed, never averaged. The MoE
balance loss of a layer on any stage reaches the backward through `inject_aux_loss`. Token ids and labels
reach every stage as keyword arguments of the schedule's ``step``, which it splits into micro-batches and
hands to each stage's forward; only the last stage reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.layout import SCHEDULES, V_SHAPED
from dsv3.model.moe import MoE
from dsv3.parallel.data_parallel import clip_by_global_norm
from dsv3.parallel.memory import local_tensor
from dsv3.parallel.pipeline_overlap import Overlap, register_overlap

IGNORE_INDEX = -100  # Transformer.loss's default


# ---- the plan: how many stages, which layers each, which rank ----------------------------------


@dataclass(frozen=True)
class PipelinePlan:
    """``ranks`` pipeline ranks running ``schedule`` over ``microbatches`` micro-batches; ``layers[s]`` main
    (non-MTP) layers in stage s, in order. The MTP layers always belong to the last stage."""

    schedule: str
    ranks: int
    microbatches: int
    layers: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``: looped (s mod P), or V-shaped for ZBV and DualPipeV."""
        if self.schedule in V_SHAPED:
            return stage if stage < self.ranks else 2 * self.ranks - 1 - stage
        return stage % self.ranks

    def stages_on(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_rank(s) == rank]

    def layer_range(self, stage: int) -> range:
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])


def plan_pipeline(cfg: ModelConfig, ranks: int, schedule: str = "1f1b", microbatches: int | None = None,
                  layers_per_stage: tuple[int, ...] | list[int] | None = None,
                  stages_per_rank: int | None = None) -> PipelinePlan:
    """A checked plan. Stages per rank: 1 for 1F1B, 2 for the V schedules, ``stages_per_rank`` (default 2)
    for interleaved. Layers: ``layers_per_stage`` when given, else balanced by layer count with the MTP
    layers counted in the last stage. Micro-batches: default twice the number of stages."""
    if schedule not in SCHEDULES:
        raise DSV3Error(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if ranks < 2:
        raise DSV3Error(f"pipeline parallelism needs at least 2 pipeline ranks, got {ranks}")
    per_rank = _stages_per_rank(schedule, stages_per_rank)
    stages = ranks * per_rank
    microbatches = 2 * stages if microbatches is None else microbatches
    _check_microbatches(schedule, ranks, stages, microbatches)
    if layers_per_stage is None:
        layers = balanced_layers(cfg.num_hidden_layers, cfg.num_nextn_predict_layers, stages)
    else:
        layers = tuple(int(n) for n in layers_per_stage)
        _check_layers(layers, cfg.num_hidden_layers, stages)
    for s, n in enumerate(layers[1:-1], start=1):
        if n == 0:
            raise DSV3Error(
                f"pipeline stage {s} of {stages} would hold no layer ({cfg.num_hidden_layers} layers); "
                "use fewer pipeline ranks or stages per rank"
            )
    return PipelinePlan(schedule, ranks, microbatches, layers)


def _stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    fixed = {"1f1b": 1, "zbv": 2, "dualpipev": 2}
    if schedule in fixed:
        if stages_per_rank not in (None, fixed[schedule]):
            raise DSV3Error(f"--pp-schedule {schedule} runs {fixed[schedule]} stage(s) per rank, not {stages_per_rank}")
        return fixed[schedule]
    per_rank = 2 if stages_per_rank is None else stages_per_rank
    if per_rank < 2:
        raise DSV3Error(f"interleaved 1F1B needs at least 2 stages per rank, got {per_rank}")
    return per_rank


def _check_microbatches(schedule: str, ranks: int, stages: int, microbatches: int) -> None:
    """The schedules' own requirements, checked before any process group exists."""
    if microbatches < 1:
        raise DSV3Error(f"--micro-batches must be at least 1, got {microbatches}")
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise DSV3Error(f"--pp-schedule {schedule} needs at least as many micro-batches as stages ({stages}), "
                        f"got {microbatches}")
    rounds = max(1, microbatches // ranks)
    if schedule == "interleaved" and microbatches % rounds:
        raise DSV3Error(f"--pp-schedule interleaved needs --micro-batches a multiple of {rounds} (the number of "
                        f"rounds of {ranks}), got {microbatches}")


def _check_layers(layers: tuple[int, ...], n_layers: int, stages: int) -> None:
    if len(layers) != stages:
        raise DSV3Error(f"layers per stage: {stages} stages need {stages} numbers, got {len(layers)}")
    if any(n < 0 for n in layers) or sum(layers) != n_layers:
        raise DSV3Error(f"layers per stage {list(layers)} must be >= 0 and add up to the {n_layers} layers")


def balanced_layers(n_layers: int, n_mtp: int, stages: int) -> tuple[int, ...]:
    """Main layers per stage, balanced by layer count with the MTP layers counted in the last stage (an MTP
    layer is a full block); earlier stages take the remainder. A last stage too small for its MTP layers
    hands its main layers to the stages before it."""
    units = n_layers + n_mtp
    sizes = [units // stages + (1 if s < units % stages else 0) for s in range(stages)]
    sizes[-1] -= n_mtp
    deficit = max(0, -sizes[-1])
    sizes[-1] = max(0, sizes[-1])
    for s in range(stages - 2, -1, -1):  # the last stage's negative share comes off the stages before it
        take = min(deficit, sizes[s])
        sizes[s] -= take
        deficit -= take
    return tuple(sizes)


# ---- the balance loss's gradient, injected where the layer runs -----------------------------------


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, d(objective)/d(aux) = ``weight`` (Megatron's MoE aux-loss
    auto-scaler). The balance loss never travels to the last stage: its gradient starts where it is
    computed, as soon as the gradient of the layer's output arrives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype, ctx.aux_device = weight, aux.dtype, aux.device
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def inject_aux_loss(x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
    """``x`` unchanged, carrying ``weight * aux`` into the objective's gradient."""
    return _InjectAuxLoss.apply(x, aux, weight)


# ---- per-step bookkeeping shared by a rank's stages ------------------------------------------------


class StepTally:
    """The step's normalizers (global label counts per MTP depth, global sequence count) and the loss
    parts this rank's stages add up over micro-batches: [lm, mtp, balance], already weighted."""

    def __init__(self) -> None:
        self.label_counts: list[int] = []
        self.sequences = 1
        self.parts = torch.zeros(3, dtype=torch.float64)

    def start(self, label_counts: list[int], sequences: int) -> None:
        self.label_counts, self.sequences = label_counts, sequences
        self.parts.zero_()

    def token_weight(self, depth: int, labels: torch.Tensor) -> float:
        """This micro-batch's share of the labelled tokens at MTP depth ``depth`` (0: the LM loss)."""
        n = int((labels != IGNORE_INDEX).sum())
        return n / self.label_counts[depth] if self.label_counts[depth] else 0.0

    def sequence_weight(self, batch: int) -> float:
        return batch / self.sequences

    def add(self, index: int, value: torch.Tensor) -> None:
        self.parts[index] += float(value.detach())


def label_counts(labels: torch.Tensor, depths: int) -> list[int]:
    """Labelled positions of labels [B, T] for the LM loss and for each MTP depth k (labels[:, k:])."""
    T = labels.shape[1]
    return [int((labels[:, k:] != IGNORE_INDEX).sum()) for k in range(depths + 1) if T - k > 0]


# ---- a stage as an nn.Module -----------------------------------------------------------------------


class StageModule(nn.Module):
    """Stage ``stage`` of ``plan`` over the model's own modules (no copies). forward(x, tokens, labels):
    x is the token ids [b, T] on the first stage, the hidden states [b, T, D] elsewhere; non-last stages
    return the hidden states, the last stage returns this micro-batch's weighted objective (a scalar)."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage: int, tally: StepTally):
        super().__init__()
        cfg: ModelConfig = model.config
        self.stage, self.first, self.last = stage, stage == 0, stage == plan.num_stages - 1
        self.tally, self.mtp_weight = tally, cfg.mtp_loss_weight
        self.activation_dtype = model.model.embed_tokens.weight.dtype
        self._model = [model]  # not a submodule: its methods (RoPE angles, head loss, MTP) are reused
        if self.first or (self.last and model.mtp_layers):
            self.embed_tokens = model.model.embed_tokens  # the MTP layers read it too
        self.layers = nn.ModuleList(model.main_layers[i] for i in plan.layer_range(stage))
        if self.last:
            self.norm, self.lm_head = model.model.norm, model.lm_head
            self.mtp_layers = nn.ModuleList(model.mtp_layers)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.hidden(x, tokens)
        if not self.last:
            # The V schedules detach a stage's output in place, which a view forbids; the balance-loss
            # carrier returns its input, which autograd makes a view: then (only then) copy.
            return x.to(self.activation_dtype, copy=x._is_view())
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        return self._objective(self._model[0], x, tokens, labels, positions)

    def hidden(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """This stage's layers over x (the token ids on the first stage, hidden states elsewhere): the hidden
        states [b, T, D] it hands on (the last stage's before the final norm)."""
        model = self._model[0]
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        cos, sin = model.angles(positions)
        if self.first:
            x = self.embed_tokens(x)
        for layer in self.layers:
            x = self._with_balance_loss(layer, layer(x, cos, sin))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's next-token logits of its hidden states x, as `Transformer.forward` gives them."""
        return self.lm_head(self.norm(x))

    def _with_balance_loss(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Collects the layer's MoE balance loss (weighted by this micro-batch's share of the sequences)
        and hooks its gradient onto the layer's output."""
        for moe in (m for m in layer.modules() if isinstance(m, MoE)):
            aux, moe.aux_loss = moe.aux_loss, None
            if aux is None or not self.training:
                continue
            weight = self.tally.sequence_weight(x.shape[0])
            self.tally.add(2, aux * weight)
            x = inject_aux_loss(x, aux, weight)
        return x

    def _objective(self, model: nn.Module, x: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
        """Transformer.loss for one micro-batch, each term weighted by its share of the global batch's
        labelled tokens: lm + lambda * mean over depths of mtp_k (the balance part is injected per layer)."""
        T = tokens.shape[1]
        h = self.norm(x)
        total = self._weighted_head_loss(model, self.lm_head, h, labels, 0)
        self.tally.add(0, total)
        mtp_terms = []
        for k in range(1, len(self.mtp_layers) + 1):
            if T - k <= 0:
                break
            h = model.mtp_hidden(k - 1, h[:, : T - k], tokens[:, k:], positions[:, : T - k])
            h = self._with_balance_loss(self.mtp_layers[k - 1], h)
            h_normed = self.mtp_layers[k - 1].shared_head.norm(h)
            mtp_terms.append(self._weighted_head_loss(model, model._mtp_head(k - 1), h_normed, labels[:, k:], k))
        if mtp_terms:
            mtp = torch.stack(mtp_terms).sum() / len(mtp_terms)
            self.tally.add(1, mtp)
            total = total + self.mtp_weight * mtp
        return total

    def _weighted_head_loss(self, model: nn.Module, head: nn.Module, h: torch.Tensor, labels: torch.Tensor,
                            depth: int) -> torch.Tensor:
        weight = self.tally.token_weight(depth, labels)
        if weight == 0.0:  # no labelled token here: the mean would be 0/0
            return h.sum() * 0.0
        return model._head_loss(head, h, labels, IGNORE_INDEX) * weight


# ---- the pipeline-parallel model: what the trainer talks to ---------------------------------------


class Elsewhere(nn.Module):
    """Stands in for a module that another pipeline rank owns (so this rank holds no copy of it)."""

    def __init__(self, name: str, rank: int):
        super().__init__()
        self.name, self.rank = name, rank

    def forward(self, *args, **kwargs):
        raise DSV3Error(f"{self.name} lives on pipeline rank {self.rank}, not on this one")

    def extra_repr(self) -> str:
        return f"{self.name} on pipeline rank {self.rank}"


def token_nats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss in nats (float64) of logits [B, T, V] against labels [B, T], positions
    labelled `IGNORE_INDEX` not counted: held-out evaluation's measure, with or without a pipeline."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX).double()


def _objective_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the weighted objective."""
    return output


def _schedule_class(name: str):
    return {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble,
            "dualpipev": ScheduleDualPipeV}[name]


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _root_cause(err: BaseException) -> str:
    """The innermost exception of a chain (the schedule wraps a stage's error in its own RuntimeError)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return str(err) if isinstance(err, DSV3Error) else f"{type(err).__name__}: {err}"


class PipelineParallel:
    """A `Transformer` split into pipeline stages, this rank's share of them, and one training step over
    a schedule. ``pp_group``: the ranks of this pipeline (default: all); ``dp_group``: the ranks holding
    the same stages in the other data-parallel replicas (default: none); ``device``: where the stages run
    (default: the model's; a model on ``meta`` is materialized after the split). Every rank must construct it
    (it creates process groups). The model is pruned in place: modules of other ranks become `Elsewhere`,
    so ``model.parameters()`` and ``model.moe_layers()`` list this rank's own.

    One optimizer step: `forward_backward` (gradients summed into ``.grad``), `sync_and_clip`,
    ``optimizer.step()``, `reduce_expert_loads` then ``model.update_router_biases()``; or `train_step`."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, pp_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None, overlap: Overlap | None = None,
                 device: torch.device | None = None):
        self.model, self.plan, self.overlap = model, plan, overlap
        if overlap is not None and plan.schedule != "dualpipev":
            raise DSV3Error(f"an overlapped forward-backward step needs --pp-schedule dualpipev, not {plan.schedule}")
        self.pp_group, self.dp_group = pp_group, dp_group
        if dist.get_world_size(pp_group) != plan.ranks:
            raise DSV3Error(f"the pipeline plan has {plan.ranks} ranks, its process group "
                            f"{dist.get_world_size(pp_group)}")
        self.pp_rank = dist.get_rank(pp_group)
        self.device = device if device is not None else next(model.parameters()).device  # meta: not yet
        self.tally = StepTally()
        every = [StageModule(model, plan, s, self.tally) for s in range(plan.num_stages)]
        self.stage_modules = [every[s] for s in plan.stages_on(self.pp_rank)]
        self.tied_names = self._tied_parameters(every)
        self._prune(every)
        self.tie_group = self._pair_group() if self.tied_names else None
        self._schedule, self._shape = None, None

    # ---- construction ----------------------------------------------------------------------------
    @property
    def tied(self) -> list[nn.Parameter]:
        """This rank's copies of tied parameters, looked up by name each time (a data-parallel transform
        such as FSDP replaces a module's Parameters by sharded ones after the split)."""
        return [self.model.get_parameter(name) for name in self.tied_names]

    def _tied_parameters(self, every: list[StageModule]) -> list[str]:
        """Names of the parameters that the first and the last stage both use, when those sit on different
        ranks (the embedding, which the MTP layers read): this rank's copy, if it holds one."""
        first, last = 0, self.plan.num_stages - 1
        if self.plan.stage_rank(first) == self.plan.stage_rank(last):
            return []  # V shape: one rank, one Parameter
        if self.pp_rank not in (self.plan.stage_rank(first), self.plan.stage_rank(last)):
            return []
        last_ids = {id(p) for p in every[last].parameters()}
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [names[id(p)] for p in every[first].parameters() if id(p) in last_ids]

    def _prune(self, every: list[StageModule]) -> None:
        """Replaces the modules that no stage of this rank uses with `Elsewhere` (freeing them here)."""
        mine = {id(m) for stage in self.stage_modules for m in stage.modules()}
        owner = {}
        for stage in every:
            for m in stage.modules():
                owner.setdefault(id(m), self.plan.stage_rank(stage.stage))
        model = self.model
        for i, layer in enumerate(model.model.layers):
            if id(layer) not in mine:
                model.model.layers[i] = Elsewhere(f"model.layers.{i}", owner.get(id(layer), -1))
        for parent, name, label in ((model.model, "embed_tokens", "model.embed_tokens"),
                                    (model.model, "norm", "model.norm"), (model, "lm_head", "lm_head")):
            child = getattr(parent, name)
            if id(child) not in mine:
                setattr(parent, name, Elsewhere(label, owner.get(id(child), -1)))

    def _pair_group(self) -> dist.ProcessGroup | None:
        """A process group of the ranks that hold the first and the last stage of this pipeline, one per
        pipeline (all ranks create all of them, as ``new_group`` requires)."""
        ends = (self.plan.stage_rank(0), self.plan.stage_rank(self.plan.num_stages - 1))
        mine = tuple(_global_rank(self.pp_group, r) for r in ends)
        pairs: list = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, mine)
        group = None
        for pair in sorted(set(pairs)):
            created = dist.new_group(list(pair))
            if pair == mine:
                group = created
        return group if self.pp_rank in ends else None

    def _schedule_for(self, batch: int, seq: int):
        """The schedule for micro-batches of this shape (stages declare their shapes up front, so no
        metadata-inference forward runs on made-up data and counts made-up expert loads)."""
        if self._shape != (batch, seq):
            self._schedule, self._shape = self._build_schedule(batch, seq), (batch, seq)
        return self._schedule

    def _build_schedule(self, batch: int, seq: int):
        M = self.plan.microbatches
        if batch % M:
            raise DSV3Error(f"a batch of {batch} sequences per data-parallel rank does not split into "
                            f"{M} micro-batches")
        stages = [self._stage(module, batch // M, seq) for module in self.stage_modules]
        try:
            cls = _schedule_class(self.plan.schedule)
            options = dict(n_microbatches=M, loss_fn=_objective_is_output, scale_grads=False)
            schedule = cls(stages[0], **options) if self.plan.schedule == "1f1b" else cls(stages, **options)
        except ValueError as err:
            raise DSV3Error(f"--pp-schedule {self.plan.schedule} with {M} micro-batches: {err}") from err
        if self.overlap is not None:
            register_overlap(schedule, self.overlap)
        return schedule

    def _stage(self, module: StageModule, micro: int, seq: int) -> PipelineStage:
        hidden = (micro, seq, self.model.config.hidden_size)
        dtype, device = module.activation_dtype, self.device
        if module.first:
            example_in = torch.zeros(micro, seq, dtype=torch.long, device=device)
        else:
            example_in = torch.zeros(hidden, dtype=dtype, device=device, requires_grad=True)
        if module.last:
            example_out = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)
        else:
            example_out = torch.zeros(hidden, dtype=dtype, device=device, requires_grad=True)
        return PipelineStage(module, module.stage, self.plan.num_stages, device, input_args=example_in,
                             output_args=example_out, group=self.pp_group)

    @property
    def schedule(self):
        """The torch schedule of the last step (None before the first): for instrumentation."""
        return self._schedule

    # ---- one step ---------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (what its optimizer updates)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
        """Runs the schedule over this data-parallel rank's batch (input_ids, labels [B, T]); gradients
        are added to ``.grad``. Returns the global [total, lm, mtp, balance] of the whole batch over all
        data-parallel ranks, as one process's `Transformer.loss` would give them (on every rank)."""
        if input_ids.dim() != 2 or input_ids.shape != labels.shape:
            raise DSV3Error(f"input_ids and labels must both be [batch, seq]; got {list(input_ids.shape)} "
                            f"and {list(labels.shape)}")
        batch, seq = input_ids.shape
        schedule = self._schedule_for(batch, seq)
        counts = torch.tensor(label_counts(labels, len(self.model.mtp_layers)) + [batch], dtype=torch.float64)
        self._dp_sum(counts)
        self.tally.start([int(n) for n in counts[:-1].tolist()], int(counts[-1]))
        try:
            schedule.step(input_ids, target=labels, tokens=input_ids, labels=labels, return_outputs=False)
        except Exception as err:
            stages = ", ".join(str(m.stage) for m in self.stage_modules)
            raise DSV3Error(f"pipeline rank {self.pp_rank} (stage {stages}): {_root_cause(err)}") from err
        parts = self.tally.parts.clone().to(self.device)
        dist.all_reduce(parts, group=self.pp_group)
        self._dp_sum(parts)
        lm, mtp, balance = parts.tolist()
        return [lm + self.model.config.mtp_loss_weight * mtp + balance, lm, mtp, balance]

    @torch.no_grad()
    def eval_nats(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Held-out evaluation through the stages, forward only, the batch as one micro-batch: the summed
        next-token loss (nats, float64) of labels [B, T] (`IGNORE_INDEX` not counted), computed by the last
        stage from its logits and broadcast, the same on every rank of this pipeline. Each rank runs only its
        stages: no rank gathers the model (the stages' modules are in eval mode meanwhile)."""
        modes = [m.training for m in self.stage_modules]
        for m in self.stage_modules:
            m.train(False)
        try:
            nats = self._forward_nats(input_ids, labels)
        finally:
            for m, mode in zip(self.stage_modules, modes, strict=True):
                m.train(mode)
        last = _global_rank(self.pp_group, self.plan.stage_rank(self.plan.num_stages - 1))
        dist.broadcast(nats, src=last, group=self.pp_group)
        return nats

    def _forward_nats(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Stage by stage in order: the owner of a stage runs it; between ranks the hidden states go by
        send/recv (every rank walks the same order, so each transfer meets its peer)."""
        mine = {m.stage: m for m in self.stage_modules}
        nats = torch.zeros((), dtype=torch.float64, device=self.device)
        x = input_ids
        for stage in range(self.plan.num_stages):
            owner = self.plan.stage_rank(stage)
            before = self.plan.stage_rank(stage - 1) if stage else owner
            if before != owner and self.pp_rank == before:
                dist.send(x.to(mine[stage - 1].activation_dtype).contiguous(),
                          dst=_global_rank(self.pp_group, owner), group=self.pp_group)
            if owner != self.pp_rank:
                continue
            module = mine[stage]
            if before != owner:
                x = torch.empty(*input_ids.shape, self.model.config.hidden_size, dtype=module.activation_dtype,
                                device=self.device)
                dist.recv(x, src=_global_rank(self.pp_group, before), group=self.pp_group)
            x = module.hidden(x, input_ids)
            if module.last:
                nats = token_nats(module.logits(x), labels.to(self.device))
        return nats

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float = math.inf) -> float:
        """For a pipeline that spans the world alone (no `parallelize`): sums gradients over the data-parallel
        replicas and the tied copies, then clips by the whole model's norm (`clip_by_global_norm`: each
        parameter counted once, by replica 0, tied copies once); returns that norm."""
        params = self.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._dp_sum(p.grad)
        self.sum_tied()
        first_replica = self.dp_group is None or dist.get_rank(self.dp_group) == 0
        counted = list(self.counted_once(params)) if first_replica else []
        return clip_by_global_norm(params, counted, max_norm, self.device)

    def sum_tied(self) -> None:
        """Adds the other end's gradient to this rank's copy of a tied parameter (the embedding; a DTensor's
        local shard under FSDP, where both ends hold the same rows)."""
        if self.tie_group is not None:
            for p in self.tied:
                dist.all_reduce(local_tensor(p.grad), group=self.tie_group)

    def counted_once(self, params: list[nn.Parameter]) -> Iterator[nn.Parameter]:
        """``params`` without the last stage's copies of tied parameters (the first stage counts them)."""
        skip = set()
        if self.tied and self.pp_rank != self.plan.stage_rank(0):
            skip = {id(p) for p in self.tied}
        return (p for p in params if id(p) not in skip)

    @torch.no_grad()
    def reduce_expert_loads(self) -> None:
        """Sums this rank's MoE token counts over the data-parallel replicas, so that every replica applies
        the aux-free bias update of the whole batch (the loads already add up over micro-batches)."""
        for moe in self.model.moe_layers():
            self._dp_sum(moe.expert_load)

    def train_step(self, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, labels: torch.Tensor,
                   max_norm: float = math.inf) -> dict[str, float]:
        """One optimizer step over the global batch (this rank's part of it); returns the global loss parts
        and the gradient norm before clipping."""
        total, lm, mtp, balance = self.forward_backward(input_ids, labels)
        grad_norm = self.sync_and_clip(max_norm)
        optimizer.step()
        self.reduce_expert_loads()
        self.model.update_router_biases()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": total, "lm_loss": lm, "mtp_loss": mtp, "balance_loss": balance, "grad_norm": grad_norm}

    def parameter_count(self) -> int:
        """Parameters of the whole model over the pipeline (tied copies once); a collective."""
        local = torch.tensor(float(sum(p.numel() for p in self.counted_once(self.parameters()))),
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(local, group=self.pp_group)
        return int(local)

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t
