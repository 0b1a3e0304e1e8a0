"""Training with expert parallelism (``--ep N``): each rank holds 1/N of every MoE layer's routed experts
(`dsv3.parallel.ep`), the rest of the model is replicated and data parallel.

What the trainer does differently under EP: no DDP (``sync_grads`` averages the replicated gradients
and scales the experts'); the gradient norm for clipping adds every rank's expert gradients; checkpoints
gather all experts into one ordinary HF folder, while each rank keeps its own optimizer state beside it
(so a resume needs the same EP size); evaluation and sampling run on all ranks in step, since every
MoE forward is a collective.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.train.distributed import World

# Wire formats of the dispatch/combine by training precision (V3: FP8 dispatch, BF16 combine).
WIRE_FORMATS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "bf16")}


def enable(
    model: nn.Module, ep: int, gpus_per_node: int, precision: str, combine: str | None, world: World
) -> None:
    """Shard the experts of ``model`` (identical on every rank) over the torchrun world."""
    from dsv3.parallel.ep import apply_expert_parallel

    if not world.distributed or ep != world.size:
        raise DSV3Error(
            f"--ep {ep} must equal the number of torchrun processes ({world.size}); start with "
            f"torchrun --nproc-per-node {ep} -m dsv3 train ... --ep {ep}"
        )
    if world.size % gpus_per_node:
        raise DSV3Error(f"--gpus-per-node {gpus_per_node} must divide the number of processes ({world.size})")
    dispatch, default_combine = WIRE_FORMATS[precision]
    apply_expert_parallel(model, gpus_per_node, dispatch=dispatch, combine=combine or default_combine)


def is_expert_parallel(model: nn.Module) -> bool:
    from dsv3.parallel.ep import ep_layers

    return bool(ep_layers(model))


def expert_parameter_ids(model: nn.Module) -> set[int]:
    from dsv3.parallel.ep import ep_layers

    return {id(p) for m in ep_layers(model) for p in m.experts.parameters()}


@torch.no_grad()
def sync_and_clip(model: nn.Module, max_norm: float, world: World) -> float:
    """Average gradients the EP way, then clip by the global norm (replicated parameters counted once,
    each rank's experts added over ranks); returns the norm before clipping."""
    from dsv3.parallel.ep import sync_grads

    sync_grads(model)
    experts = expert_parameter_ids(model)
    grads = [(p.grad, id(p) in experts) for p in model.parameters() if p.grad is not None]
    dense_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if not is_expert), torch.zeros(()))
    expert_sq = sum((g.float().pow(2).sum() for g, is_expert in grads if is_expert), torch.zeros(()))
    total_sq = dense_sq.to(world.device) + world.sum_(expert_sq.to(world.device))
    norm = float(total_sq.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        for g, _ in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


@torch.no_grad()
def gathered_model(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A single-process `Transformer` with every expert, built on every rank (a collective: all ranks
    must call it). Shares the replicated tensors with ``model``; meant for saving and sampling."""
    from dsv3.model.rope import inverse_frequencies
    from dsv3.model.transformer import Transformer
    from dsv3.parallel.ep import ExpertParallelMoE

    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for pname, full in module.logical_expert_weights().items():
                state[f"{name}.experts.{pname}"] = full
    with torch.device("meta"):
        full_model = Transformer(cfg)
    full_model.load_state_dict(state, strict=True, assign=True)
    device = next(model.parameters()).device
    full_model.inv_freq = inverse_frequencies(cfg)[0].to(device)
    for moe in full_model.moe_layers():
        moe.expert_load = torch.zeros(cfg.n_routed_experts, device=device)
    return full_model.train(model.training)
