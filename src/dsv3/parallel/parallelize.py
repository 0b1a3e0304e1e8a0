"""`parallelize(model, layout)`: a layout's parallelism applied to a plain model, one transform per axis, and
the one object the trainer talks to.

The transforms run in a fixed order over one `ParallelMesh`, each a function of the model and the mesh
that knows nothing of the others:

1. `split_pipeline`: the model cut into stages (``pp``); this rank keeps only its stages' modules;
2. `place_experts`: each MoE layer held here gets the two-hop dispatcher over its EP group and only its
   share of the routed experts (``ep``);
3. `shard_data_parallel`: the copies over the data-parallel ranks replicated, ZeRO-1- or FSDP-sharded
   (``dp_shard``), for whatever parameters the first two left on this rank.

`Parallelized` then owns what the trainer must not branch on: a step's forward and backward (a pipeline
schedule or one forward per micro-step), the gradient sync and ONE clip by the global norm over the whole
mesh, the expert-load reduction behind the aux-free bias update, the whole model for sampling, DCP
checkpoints keyed by the model's names (so any layout resumes any other). A single process is the all-ones
layout through the same code; its collectives are no-ops.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.dispatch import LocalDispatcher
from dsv3.model.moe import MoE
from dsv3.parallel.data_parallel import FSDP, Replicas, Replicate, Zero1, clip_by_global_norm, shard_units, world_sum
from dsv3.parallel.ep import ep_layers, logical_expert_weights, make_expert_parallel
from dsv3.parallel.memory import local_tensor
from dsv3.parallel.mesh import ParallelMesh
from dsv3.parallel.pipeline import Elsewhere, PipelineParallel, label_counts, plan_pipeline, token_nats
from dsv3.parallel.pipeline_overlap import Overlap, run_concurrently


def parallelize(model: nn.Module, layout: Layout | None = None, overlap: Overlap | None = None,
                device: torch.device | None = None) -> Parallelized:
    """Apply ``layout`` (default: one process) to ``model`` (a `Transformer`, the same on every rank: same
    seed or checkpoint) in place and return the object that trains it. Every rank must call it.
    ``overlap``: how DualPipeV runs its overlapped forward-backward pairs (default: concurrently under EP,
    V3's overlap; `pipeline_overlap.run_in_order` is the reference). ``device``: where the model will run
    (default: its parameters'); a model built on ``meta`` is laid out as it is, then given this rank's
    tensors on ``device`` by `dsv3.parallel.materialize.materialize`."""
    layout = (layout or Layout()).check(_world_size())
    device = torch.device(device) if device is not None else next(model.parameters()).device
    mesh = ParallelMesh.build(layout, device)
    pipe = split_pipeline(model, mesh, overlap, device)
    place_experts(model, mesh, pipe)
    data = shard_data_parallel(model, mesh, pipe)
    return Parallelized(model, layout, mesh, pipe, data, device)


# ---- the transforms ----------------------------------------------------------------------------


def split_pipeline(model: nn.Module, mesh: ParallelMesh, overlap: Overlap | None = None,
                   device: torch.device | None = None) -> PipelineParallel | None:
    """Cut ``model`` into the layout's pipeline stages over the ``pp`` groups (None without a pipeline)."""
    layout = mesh.layout
    if layout.pp == 1:
        return None
    if layout.schedule != "dualpipev":
        overlap = None
    elif overlap is None and layout.ep > 1:
        overlap = run_concurrently
    plan = plan_pipeline(model.config, layout.pp, layout.schedule, layout.pipeline_microbatches)
    return PipelineParallel(model, plan, pp_group=mesh.group("pp"), dp_group=mesh.group("dp"), overlap=overlap,
                            device=device)


def place_experts(model: nn.Module, mesh: ParallelMesh, pipe: PipelineParallel | None) -> None:
    """Expert parallelism: every MoE layer held here gets the two-hop dispatcher over its EP group and only
    this rank's share of its routed experts. Each of a rank's stages gets communicators of its own (DualPipeV
    runs one stage's forward beside the other's backward). Without EP, the local dispatchers simulate the
    layout's combine format when one is asked for."""
    layout = mesh.layout
    if layout.ep == 1:
        if layout.combine is not None:
            for d in model.modules():
                if isinstance(d, LocalDispatcher):
                    d.combine_format = layout.combine
        return
    holders = pipe.stage_modules if pipe is not None else [model]
    if not any(isinstance(m, MoE) for holder in holders for m in holder.modules()):
        raise DSV3Error("--ep: the model has no MoE layers to make expert-parallel")
    for copy, holder in enumerate(holders):
        groups = mesh.ep_groups(copy)
        for moe in (m for m in holder.modules() if isinstance(m, MoE) and isinstance(m.dispatcher, LocalDispatcher)):
            make_expert_parallel(moe, groups, None, layout.dispatch, layout.ep_combine)


def shard_data_parallel(model: nn.Module, mesh: ParallelMesh, pipe: PipelineParallel | None):
    """The data-parallel axis over what is left on this rank: dense parameters copied over the stage's
    ``dp`` replicas, routed experts over their ``ep_replicate`` group (`dsv3.parallel.data_parallel`)."""
    layout = mesh.layout
    divisor = 1 if pipe is not None else layout.dp  # a pipeline's losses are weighted by the global batch
    experts = {id(p) for m in ep_layers(model) for p in m.experts.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    dense = Replicas([p for p in params if id(p) not in experts], mesh.ranks("dp"), mesh.group("dp"), divisor)
    routed = Replicas([p for p in params if id(p) in experts], mesh.ranks("ep_replicate"),
                      mesh.group("ep_replicate"), divisor)
    if layout.dp_shard == "zero1":
        return Zero1([dense, routed], zero_fill=pipe is not None)
    if layout.dp_shard == "fsdp":
        units = fsdp_units(model, pipe)
        shard_units(units, mesh.sub("dp"), set(routed.params), 1.0 if pipe is not None else None)
        if pipe is None:
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(model, "loss")  # the root's parameters gathered for the training step
        return FSDP(model, Replicate([routed]), units)
    return Replicate([dense, routed])


def fsdp_units(model: nn.Module, pipe: PipelineParallel | None) -> list[nn.Module]:
    """What FSDP2 shards as one unit each, inner first: every Block held here, then the rest. Without a
    pipeline the rest is one root, the model (embedding, final norm, head and the MTP modules, which read
    the embedding and head); a pipeline rank shards each of its remaining modules on its own, since two
    stages on one rank (the V schedules) share the embedding."""
    blocks = [m for m in model.main_layers if not isinstance(m, Elsewhere)]
    if pipe is None:
        return [*blocks, model]
    rest = [m for m in (*model.mtp_layers, model.model.embed_tokens, model.model.norm, model.lm_head)
            if not isinstance(m, Elsewhere)]
    return [*blocks, *rest]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ---- what the trainer talks to -----------------------------------------------------------------


class LossStep(nn.Module):
    """``model.loss`` as a forward; returns the loss and its detached parts [total, lm, mtp, balance].

    ``weights`` (one per head: the LM's, then each MTP depth's) scale each head's mean loss: a data-parallel
    rank's share of the global micro-batch's labelled tokens times the number of ranks, so that averaging
    the ranks' gradients gives the mean over every labelled token, as one process would (with a loss mask
    the ranks' label counts differ). None: all 1."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                weights: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.loss(input_ids, labels)
        zero = out.loss.new_zeros(())
        loss, lm, mtp = out.loss, out.lm_loss, out.mtp_loss
        if weights is not None and any(w != 1.0 for w in weights):
            lm = lm * weights[0]
            mtp = torch.stack([m * w for m, w in zip(out.mtp_losses, weights[1:], strict=False)]).mean() \
                if out.mtp_losses else None
            loss = lm + (self.model.config.mtp_loss_weight * mtp if mtp is not None else 0.0) + \
                (out.balance_loss if out.balance_loss is not None else 0.0)
        parts = torch.stack([loss.detach().float(), lm.detach().float(),
                             (mtp if mtp is not None else zero).detach().float(),
                             (out.balance_loss if out.balance_loss is not None else zero).detach().float()])
        return loss, parts


class Parallelized:
    """A model under a layout: whatever differs between layouts, behind one interface (`parallelize`)."""

    def __init__(self, model: nn.Module, layout: Layout, mesh: ParallelMesh, pipe: PipelineParallel | None, data,
                 device: torch.device | None = None):
        self.model, self.layout, self.mesh, self.pipe, self.data = model, layout, mesh, pipe, data
        self.world = layout.world
        self.step = LossStep(model)
        self.device = device if device is not None else next(model.parameters()).device

    # ---- who does what ------------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        """How many data-parallel ranks split each global batch."""
        return self.layout.dp

    @property
    def data_rank(self) -> int:
        """This process's index among the data-parallel ranks (its slice of every global batch)."""
        return self.mesh.local_rank("dp")

    def check_batch(self, per_rank: int) -> None:
        """Refuse a per-rank micro-batch size the layout cannot run."""
        if self.pipe is not None and per_rank % self.pipe.plan.microbatches:
            raise DSV3Error(
                f"each data-parallel replica gets {per_rank} sequences per micro-step (--batch-size / "
                f"(replicas x --grad-accum)), which does not split into --micro-batches "
                f"{self.pipe.plan.microbatches}; make it a multiple")

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for a micro-step that is not the step's last: its backward skips the gradient sync."""
        return self.data.no_sync()

    def expert_parameter_ids(self) -> set[int]:
        return {id(p) for m in ep_layers(self.model) for p in m.experts.parameters()}

    # ---- one step -------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, detached [total, lm, mtp, balance]) of this rank's micro-batch."""
        if self.pipe is not None:
            raise DSV3Error("a pipeline-parallel model runs whole steps: call forward_backward")
        return self.step(input_ids, labels)

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast,
                         grad_accum: int) -> list[float]:
        """Backward of the mean loss over the global batch (this rank's ``batches``, one per micro-step);
        returns its [total, lm, mtp, balance] averaged over the micro-steps and the data-parallel ranks."""
        if self.pipe is not None:
            return self._pipeline_forward_backward(batches, autocast, grad_accum)
        sums = torch.zeros(4, dtype=torch.float64)
        for j, (inputs, labels) in enumerate(batches):
            weights = self._label_weights(labels)
            with contextlib.nullcontext() if j == len(batches) - 1 else self.no_sync():
                with autocast:
                    loss, parts = self.step(inputs, labels, weights)
                (loss / grad_accum).backward()
            sums += parts.double().cpu()
        return (self.sum_(sums.to(self.device)).cpu() / (self.data_size * grad_accum)).tolist()

    def _label_weights(self, labels: torch.Tensor) -> list[float] | None:
        """Each head's weight for this rank's micro-batch (`LossStep`): its labelled tokens over the
        global micro-batch's, times the data-parallel ranks; None with one rank (a collective)."""
        if self.data_size == 1:
            return None
        mine = torch.tensor(label_counts(labels, len(self.model.mtp_layers)), dtype=torch.float64)
        total = self.sum_(mine.clone().to(self.device)).cpu()
        return [float(n * self.data_size / t) if t else 0.0 for n, t in zip(mine.tolist(), total.tolist(), strict=True)]

    def _pipeline_forward_backward(self, batches, autocast, grad_accum: int) -> list[float]:
        """One schedule per micro-step (each normalised by its own global token counts), then gradients
        scaled by 1/grad_accum: the mean over micro-steps. Global parts on every rank."""
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

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Finish the gradient sync (the pipeline's tied copies, then the data-parallel sets), then clip every
        gradient by the global norm of the whole model over the mesh; returns the norm before clipping."""
        if self.pipe is not None:
            for p in self.pipe.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.pipe.sum_tied()
        self.data.reduce()
        return clip_by_global_norm(self.data.updated(), self._counted(self.data.counted()), max_norm, self.device)

    def _counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less the pipeline's second copies of tied parameters (the first stage counts them)."""
        return list(self.pipe.counted_once(params)) if self.pipe is not None else params

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) over the data-parallel ranks (of this stage), in place; returns t."""
        group = self.mesh.group("dp")
        if group is not None and self.mesh.size("dp") > 1:
            dist.all_reduce(t, group=group)
        return t

    # ---- the aux-free bias update ---------------------------------------------------------------
    @torch.no_grad()
    def reduce_expert_loads(self) -> None:
        """Sum every MoE layer's token counts over the data-parallel ranks, so that every rank applies the
        same aux-free bias update, the one a single process would."""
        for moe in self.model.moe_layers():
            self.sum_(moe.expert_load)

    def expert_loads(self) -> list[list[int]]:
        """Every MoE layer's token counts (after `reduce_expert_loads`), in the whole model's layer order."""
        return self._by_layer([[int(x) for x in moe.expert_load.tolist()] for moe in self.model.moe_layers()])

    def update_router_biases(self) -> list[float]:
        """The aux-free bias update of every MoE layer held here; returns the whole model's max/mean loads."""
        return self._by_layer(self.model.update_router_biases())

    def _by_layer(self, values: list) -> list:
        """``values`` (one per MoE layer held here) for the whole model in layer order: gathered over the
        pipeline, whose ranks hold different layers."""
        if self.pipe is None:
            return values
        mine = list(zip(self._moe_layer_indices(), values, strict=True))
        gathered: list = [None] * self.layout.pp
        dist.all_gather_object(gathered, mine, group=self.mesh.group("pp"))
        return [v for _, v in sorted(pair for part in gathered for pair in part)]

    def _moe_layer_indices(self) -> list[tuple[int, int]]:
        """(layer index, MoE index inside it) of every MoE module held here, in ``moe_layers()`` order."""
        where = {}
        for i, layer in enumerate(self.model.model.layers):
            if not isinstance(layer, Elsewhere):
                for j, m in enumerate(x for x in layer.modules() if isinstance(x, MoE)):
                    where[id(m)] = (i, j)
        return [where[id(m)] for m in self.model.moe_layers()]

    # ---- the whole model ------------------------------------------------------------------------
    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """The whole model as one plain single-process `Transformer` on every rank (a collective): FSDP
        shards all-gathered, every MoE layer's experts gathered over its EP group, the stages gathered over
        the pipeline. The model itself when nothing is split."""
        if self.layout.pp == 1 and self.layout.ep == 1 and self.layout.dp_shard != "fsdp":
            return self.model
        state = {name: _full(t) for name, t in self.model.state_dict().items()}
        names = {id(m): name for name, m in self.model.named_modules()}
        for moe in ep_layers(self.model):
            for pname, full in logical_expert_weights(moe).items():
                state[f"{names[id(moe)]}.experts.{pname}"] = full
        if self.pipe is not None:
            parts: list = [None] * self.layout.pp
            dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in state.items()},
                                   group=self.mesh.group("pp"))
            state = {k: v.to(self.device) for part in parts for k, v in part.items()}
        return plain_model(self.model, state, self.device)

    def eval_nats(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed held-out loss (nats, float64) of one evaluation batch, forward only (a collective
        under EP, FSDP or a pipeline): through the stages under a pipeline (`PipelineParallel.eval_nats`,
        the same on every rank of the pipeline), else from the model's logits."""
        if self.pipe is not None:
            return self.pipe.eval_nats(inputs.to(self.device), labels)
        return token_nats(self.model(inputs.to(self.device)), labels.to(self.device))

    def windows_for_eval(self, windows: list[int]) -> list[int]:
        """The evaluation windows: all of them, or when every forward is a collective (EP, FSDP) as many on
        every rank, or under a pipeline on every data-parallel replica (`equal_share`)."""
        if self.layout.ep == 1 and self.layout.dp_shard != "fsdp":
            return windows
        return equal_share(windows, self.world if self.pipe is None else self.data_size)

    def eval_share(self, windows: list[int], rank: int) -> tuple[list[int], bool]:
        """(the evaluation windows of global rank ``rank``, whether its sums count): split over the ranks, or
        under a pipeline over the data-parallel replicas, whose pipeline ranks all take their replica's
        windows (each stage needs them) and all get its sums, counted once (by pipeline rank 0)."""
        if self.pipe is None:
            return windows[rank:: self.world], True
        return windows[self.data_rank:: self.data_size], self.pipe.pp_rank == 0

    def parameter_count(self) -> int:
        """Parameters of the whole model, each counted once over the mesh (a collective)."""
        mine = sum(local_tensor(p).numel() for p in self._counted(self.data.counted()))
        return int(world_sum(torch.tensor(float(mine), dtype=torch.float64, device=self.device)))

    # ---- optimizer and checkpoints ---------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once with the optimizer built over ``model.parameters()``: ZeRO-1 hooks its step."""
        self.data.attach_optimizer(optimizer)

    def updated_parameters(self) -> list[nn.Parameter]:
        """The parameters whose optimizer state this rank keeps (ZeRO-1: only those it owns)."""
        return self.data.updated()

    def save_state(self, folder, optimizer: torch.optim.Optimizer) -> None:
        """Write this rank's share of the model and optimizer state into the DCP checkpoint ``folder``, keyed
        by the whole model's names (`dsv3.parallel.checkpoint`); a collective over every rank."""
        from dsv3.parallel.checkpoint import save_state

        save_state(folder, self.model, optimizer)

    def load_state(self, folder, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's share from a DCP checkpoint that any layout wrote (resharding); a collective."""
        from dsv3.parallel.checkpoint import load_state

        load_state(folder, self.model, optimizer, self.updated_parameters())

    def checkpoint_fields(self) -> dict:
        """What a checkpoint records about the layout (a resume reads it)."""
        return {"world_size": self.world, "ep_size": self.layout.ep if self.layout.ep > 1 else 0,
                "layout": self.layout.to_dict()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); any other tensor itself."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def plain_model(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A plain `Transformer` of ``model``'s config holding the full tensors ``state``, in ``model``'s mode."""
    from dsv3.model.transformer import Transformer

    with torch.device("meta"):
        full = Transformer(model.config)
    full.load_state_dict(state, strict=True, assign=True)
    full.init_buffers(device)
    return full.train(model.training)


def equal_share(windows: list[int], world: int) -> list[int]:
    """Evaluation windows that split evenly over ``world`` ranks, for layouts whose every forward is a
    collective: the first multiple-of-``world`` windows, or with fewer windows than ranks every window
    repeated alike (the same mean loss; a rank left without a window would hang the others)."""
    if len(windows) >= world:
        return windows[: len(windows) // world * world]
    return windows * (world // math.gcd(len(windows), world)) if windows else windows
