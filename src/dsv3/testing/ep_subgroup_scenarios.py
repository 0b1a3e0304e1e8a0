"""Multi-process check of expert parallelism over part of the data-parallel ranks (``Layout(dp=D, ep=E)``,
E < D), run by the tests through `launch`: a few AdamW steps of a tiny Transformer through `parallelize`,
with gradient clipping that bites, against the same steps in one process on the whole global batch; then
the checkpoint that `full_model` gives, saved and loaded back as an ordinary model."""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv3.layout import Layout
from dsv3.parallel.ep import ep_layers
from dsv3.parallel.parallelize import parallelize
from dsv3.testing.ep_scenarios import tiny_config


@dataclass(frozen=True)
class SubgroupSpec:
    ep: int = 2
    gpus_per_node: int = 1
    steps: int = 5
    seq_len: int = 8
    seqs_per_rank: int = 1
    lr: float = 1e-2
    max_norm: float = 0.5  # below the first steps' norms: clipping must count each expert once
    seed: int = 0


def subgroup_train_worker(rank: int, world: int, spec: SubgroupSpec) -> dict | None:
    """``spec.steps`` AdamW steps with EP groups of ``spec.ep`` among ``world`` data-parallel ranks; rank 0
    also runs them in one process and returns both runs' losses, norms, biases and logits."""
    from dsv3 import load_pretrained
    from dsv3.model.transformer import Transformer

    cfg = tiny_config(spec.ep // spec.gpus_per_node)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg)
    reference = copy.deepcopy(model) if rank == 0 else None
    parallel = parallelize(model, Layout(dp=world, ep=spec.ep, gpus_per_node=spec.gpus_per_node))
    data = torch.randint(
        0, cfg.vocab_size, (spec.steps, world * spec.seqs_per_rank, spec.seq_len + 1),
        generator=torch.Generator().manual_seed(spec.seed + 1),
    )
    mine = slice(rank * spec.seqs_per_rank, (rank + 1) * spec.seqs_per_rank)
    losses, norms = _train_parallel(parallel, data[:, mine], spec)
    replicas_equal = expert_replicas_equal(model, parallel.mesh.group("ep_replicate"))
    parameters = parallel.parameter_count()
    full = parallel.full_model()  # a collective: every rank
    if rank != 0:
        return None
    ref_losses, ref_norms = _train_single(reference, data, spec)
    ids = torch.randint(0, cfg.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(7))
    with tempfile.TemporaryDirectory() as tmp:
        full.save_pretrained(Path(tmp) / "ckpt")
        loaded = load_pretrained(Path(tmp) / "ckpt", dtype=torch.float32).eval()
        with torch.no_grad():
            logits_diff = float((loaded(ids) - reference.eval()(ids)).abs().max())
    bias = [m.gate.e_score_correction_bias for m in ep_layers(model)]
    ref_bias = [m.gate.e_score_correction_bias for m in reference.moe_layers()]
    return {
        "kind": type(parallel).__name__,
        "is_subgroup": parallel.mesh.size("ep") < parallel.mesh.size("dp"),
        "ep_ranks": parallel.mesh.ranks("ep"),
        "replica_ranks": parallel.mesh.ranks("ep_replicate"),
        "experts_here": [m.experts.gate_proj.shape[0] for m in ep_layers(model)],
        "losses": losses,
        "single_losses": ref_losses,
        "norms": norms,
        "single_norms": ref_norms,
        "bias_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(bias, ref_bias, strict=True)),
        "bias_max_abs": max(float(b.abs().max()) for b in ref_bias),
        "replicas_equal": replicas_equal,
        "parameters": parameters,
        "single_parameters": sum(p.numel() for p in reference.parameters()),
        "logits_max_abs_diff": logits_diff,
    }


def _train_parallel(parallel, data: torch.Tensor, spec: SubgroupSpec) -> tuple[list[float], list[float]]:
    """The trainer's step through the layout object: backward, sync and clip, summed loads, AdamW, biases."""
    model = parallel.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    losses, norms = [], []
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss, _ = parallel(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norms.append(parallel.sync_and_clip(spec.max_norm))
        parallel.reduce_expert_loads()
        opt.step()
        model.update_router_biases()
        losses.append(float(parallel.sum_(loss.detach().clone()) / parallel.world))
    return losses, norms


def _train_single(model, data: torch.Tensor, spec: SubgroupSpec) -> tuple[list[float], list[float]]:
    """The same steps in one process on the whole global batch."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    losses, norms = [], []
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch[:, :-1], batch[:, 1:]).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_norm)))
        opt.step()
        model.update_router_biases()
        losses.append(float(loss.detach()))
    return losses, norms


def subgroup_trains_worker(rank: int, world: int, specs: list[SubgroupSpec]) -> list[dict | None]:
    """Several layouts in one launch (process start-up dominates on a small machine)."""
    return [subgroup_train_worker(rank, world, spec) for spec in specs]


def expert_replicas_equal(model: torch.nn.Module, replica_group) -> bool:
    """Whether every replica of this rank's expert shard holds the same weights (a collective over the
    replica group; replicas are never re-synchronised, they stay equal by construction)."""
    import torch.distributed as dist

    same = torch.ones(())
    for m in ep_layers(model):
        for p in m.experts.parameters():
            lo, hi = p.detach().float().clone(), p.detach().float().clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=replica_group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=replica_group)
            same = same * float(torch.equal(lo, hi))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())
