"""Multi-process checks of pipeline parallelism, run by the tests through `launch`: a tiny Transformer
trained for a few AdamW steps by `PipelineParallel` on gloo processes (pipeline x data-parallel ranks),
or with expert parallelism inside the stages by the trainer's own calls on `parallelize`'s object, next to
the same model trained by one process with the same seed, global batches and data order.
Every rank returns its losses and the state of the parameters it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.transformer import Transformer
from dsv3.parallel.ep import ep_layers
from dsv3.parallel.parallelize import parallelize
from dsv3.parallel.pipeline import PipelineParallel, plan_pipeline
from dsv3.parallel.pipeline_overlap import run_in_order
from dsv3.train.precision import apply_fp8, autocast


@dataclass(frozen=True)
class PipeSpec:
    """One run: ``pp`` pipeline ranks x ``dp`` data-parallel replicas on ``schedule``; ``batch`` is the
    global batch (split over the replicas, then into ``microbatches``). ``fail_rank``: that rank's stage
    raises during step 2 (the error path)."""

    schedule: str
    pp: int
    dp: int = 1
    microbatches: int = 4
    layers: int = 3
    layers_per_stage: tuple[int, ...] | None = None
    batch: int = 8
    seq: int = 12
    steps: int = 5
    seed: int = 0
    lr: float = 1e-2
    grad_clip: float = 0.5
    fail_rank: int | None = None
    overlap: bool = False  # DualPipeV: run OVERLAP_F_B through the registered custom function
    ep: int = 1  # > 1: each stage's routed experts over EP groups of ep of its dp replicas (`parallelize`)
    concurrent: bool = True  # with ep > 1 under DualPipeV: OVERLAP_F_B pairs run concurrently (else in order)
    precision: str = "fp32"  # "fp8" (ep > 1 and the reference): FP8 linears and experts, FP8 dispatch

    @property
    def world(self) -> int:
        return self.pp * self.dp


def spec_config(base: ModelConfig, spec: PipeSpec) -> ModelConfig:
    """``base`` with the spec's depth, MoE from layer 1 on, one MTP layer, and balancing strong enough to
    matter in five steps (a balance loss weight and bias speed far above the defaults)."""
    return base.replace(num_hidden_layers=spec.layers, first_k_dense_replace=1, num_nextn_predict_layers=1,
                        aux_loss_alpha=0.01, bias_update_speed=0.01)


def batches(spec: PipeSpec, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global (input_ids, labels) [batch, seq] of every step, from the spec's seed."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    out = []
    for _ in range(spec.steps):
        tokens = torch.randint(0, vocab, (spec.batch, spec.seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _optimizer(params, spec: PipeSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.1)


def single_process_run(base: ModelConfig, spec: PipeSpec) -> dict:
    """The reference: `Transformer.loss` over the whole batch, clipping, AdamW, the bias update."""
    cfg = spec_config(base, spec)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    if spec.precision == "fp8":
        apply_fp8(model)
    optimizer = _optimizer(model.parameters(), spec)
    losses = []
    for input_ids, labels in batches(spec, cfg.vocab_size):
        with autocast(spec.precision, torch.device("cpu")):
            out = model.loss(input_ids, labels)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip))
        optimizer.step()
        model.update_router_biases()
        optimizer.zero_grad(set_to_none=True)
        parts = [out.loss, out.lm_loss, out.mtp_loss, out.balance_loss]
        losses.append([float(p.detach()) for p in parts] + [grad_norm])
    return {"losses": losses, "state": _state(model)}


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Parameters and buffers by name, as numpy arrays (a worker's tensors cannot outlive it in a queue)."""
    return {name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()}


def pipeline_worker(rank: int, world: int, base: ModelConfig, specs: list[PipeSpec]) -> list[dict]:
    """Runs every spec (each on all ``world`` ranks) and returns this rank's results, one per spec."""
    return [_pipeline_run(rank, world, base, spec) for spec in specs]


def _pipeline_run(rank: int, world: int, base: ModelConfig, spec: PipeSpec) -> dict:
    if spec.world != world:
        raise DSV3Error(f"spec {spec.schedule} needs {spec.world} processes, {world} are running")
    if spec.ep > 1:
        return _pipeline_ep_run(rank, base, spec)
    mesh = init_device_mesh("cpu", (spec.dp, spec.pp), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    cfg = spec_config(base, spec)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    plan = plan_pipeline(cfg, spec.pp, spec.schedule, spec.microbatches, spec.layers_per_stage)
    overlap = CountingInOrder() if spec.overlap else None
    pipe = PipelineParallel(model, plan, mesh.get_group("pp"), mesh.get_group("dp"), overlap=overlap)
    optimizer = _optimizer(pipe.parameters(), spec)
    per_replica = spec.batch // spec.dp
    rows = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
    losses = []
    for step, (input_ids, labels) in enumerate(batches(spec, cfg.vocab_size), start=1):
        if spec.fail_rank == rank and step == 2:
            _fail_in_forward(pipe)
        out = pipe.train_step(optimizer, input_ids[rows], labels[rows], spec.grad_clip)
        losses.append([out["loss"], out["lm_loss"], out["mtp_loss"], out["balance_loss"], out["grad_norm"]])
    return {"losses": losses, "state": _state(model), "stages": [m.stage for m in pipe.stage_modules],
            "parameter_count": pipe.parameter_count(), "whole_model_call": _call_pruned(model),
            "overlapped_pairs": overlap.pairs if overlap else 0,
            "finite": all(math.isfinite(x) for row in losses for x in row)}


def _call_pruned(model: torch.nn.Module) -> str:
    """What calling the pruned model as a whole says on this rank (it must refuse, naming the owner)."""
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
    except DSV3Error as err:
        return str(err)
    return "ran"


class CountingInOrder:
    """The in-order overlap function, counting the OVERLAP_F_B pairs it was handed."""

    def __init__(self) -> None:
        self.pairs = 0

    def __call__(self, forward, backward) -> None:
        self.pairs += 1
        run_in_order(forward, backward)


def _fail_in_forward(pipe: PipelineParallel) -> None:
    """Makes this rank's first stage raise in its next forward, halfway through a schedule step."""
    def boom(module, args):
        raise RuntimeError("injected failure")

    pipe.stage_modules[0].register_forward_pre_hook(boom)


def train_steps(parallel, optimizer: torch.optim.Optimizer, spec: PipeSpec, cfg: ModelConfig) -> list[list[float]]:
    """The spec's training steps through a layout object (this replica's rows of every global batch):
    per step [total, lm, mtp, balance, grad_norm], the aux-free bias update included."""
    per_replica = spec.batch // spec.dp
    rows = slice(parallel.data_rank * per_replica, (parallel.data_rank + 1) * per_replica)
    losses = []
    for input_ids, labels in batches(spec, cfg.vocab_size):
        parts = parallel.forward_backward([(input_ids[rows], labels[rows])],
                                          autocast(spec.precision, torch.device("cpu")), 1)
        grad_norm = parallel.sync_and_clip(spec.grad_clip)
        optimizer.step()
        parallel.reduce_expert_loads()
        parallel.update_router_biases()
        optimizer.zero_grad(set_to_none=True)
        losses.append(parts + [grad_norm])
    return losses


def _pipeline_ep_run(rank: int, base: ModelConfig, spec: PipeSpec) -> dict:
    """``spec`` through ``parallelize(model, Layout(pp, dp, ep, schedule))`` and the trainer's calls on the
    object it returns. Every rank returns its losses and biases; rank 0 also the gathered whole model."""
    cfg = spec_config(base, spec)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    if spec.precision == "fp8":
        apply_fp8(model)
    layout = Layout(pp=spec.pp, dp=spec.dp, ep=spec.ep, schedule=spec.schedule, microbatches=spec.microbatches,
                    dispatch="fp8" if spec.precision == "fp8" else "fp32")
    overlap = run_in_order if spec.schedule == "dualpipev" and not spec.concurrent else None
    parallel = parallelize(model, layout, overlap=overlap)
    optimizer = _optimizer(parallel.model.parameters(), spec)
    losses = train_steps(parallel, optimizer, spec, cfg)
    full = parallel.full_model()  # a collective
    count = parallel.parameter_count()
    biases = {k: v for k, v in _state(model).items() if k.endswith("e_score_correction_bias")}
    return {"losses": losses, "biases": biases, "parameter_count": count, "kind": type(parallel).__name__,
            "experts_here": [m.experts.gate_proj.shape[0] for m in ep_layers(model)],
            "expert_kinds": sorted({type(m.experts).__name__ for m in ep_layers(model)}),
            "overlap": getattr(parallel.pipe.overlap, "__name__", None),
            "full_state": _state(full) if rank == 0 else None}
