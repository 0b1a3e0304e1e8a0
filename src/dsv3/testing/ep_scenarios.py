"""Multi-process checks of the expert-parallel dispatcher against the single-process `MoE`, run by
`dsv3 bench ep` and the tests through `launch`: one MoE layer forward + backward on random inputs (plain or
FP8 experts), and a few training steps of a tiny Transformer through `parallelize`. Every rank returns its
part; rank 0 also computes the single-process reference.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.moe import MoE
from dsv3.parallel.ep import (
    ExpertParallelDispatcher,
    ep_layers,
    forward_micro_batches,
    make_expert_parallel,
    set_placement,
)
from dsv3.parallel.ep_groups import NodeLayout, make_ep_groups
from dsv3.parallel.ep_traffic import analytic_bytes, copy_counts
from dsv3.parallel.parallelize import parallelize
from dsv3.parallel.placement import Placement

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer on ``nodes * gpus_per_node`` ranks; ``tokens`` per rank. n_group = nodes, so
    ``topk_groups`` is the node limit M."""

    nodes: int = 2
    gpus_per_node: int = 2
    experts: int = 16
    topk: int = 4
    topk_groups: int = 2
    tokens: int = 16
    hidden: int = 128
    inter: int = 32
    dispatch: str = "fp32"
    combine: str = "fp32"
    dtype: str = "float32"
    shared: int = 1
    seed: int = 0
    skew: float = 0.0  # > 0: a Zipf-like selection bias that makes some experts hot (for EPLB)
    phy2log: tuple[int, ...] | None = None  # an EPLB placement; None: contiguous
    move_to_placement: bool = False  # start contiguous, then move the weights with set_placement
    overlap_repeats: int = 0  # > 0: also time two micro-batches sequential vs overlapped
    fp8: bool = False  # the training recipe's FP8 (dsv3.train.precision.apply_fp8): FP8 experts and linears

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def config(self) -> ModelConfig:
        cfg = ModelConfig(
            hidden_size=self.hidden,
            moe_intermediate_size=self.inter,
            n_routed_experts=self.experts,
            num_experts_per_tok=self.topk,
            n_group=self.nodes,
            topk_group=self.topk_groups,
            n_shared_experts=self.shared,
            rope_scaling=None,
            aux_loss_alpha=1e-2,
            routed_scaling_factor=2.5,
        )
        problems = cfg._moe_problems()
        if self.experts % self.world:
            problems.append(f"{self.experts} experts cannot be split over {self.world} ranks")
        if problems:
            raise DSV3Error("; ".join(problems))
        return cfg

    def placement(self) -> Placement | None:
        return None if self.phy2log is None else Placement(torch.tensor(self.phy2log), self.world)


def build_layer(spec: LayerSpec) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """The single-process layer with random weights and router bias, the inputs [W, T, D] (rank r's
    tokens are row r) and a fixed upstream gradient [W, T, D]. Same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(spec.seed)
    moe = MoE(spec.config())
    D, I, E = spec.hidden, spec.inter, spec.experts
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, D, generator=gen) / D**0.5)
        hot = -torch.log(torch.randperm(E, generator=gen).double() + 1).float()  # 0 for the hottest
        moe.gate.e_score_correction_bias.copy_(0.1 * torch.randn(E, generator=gen) + spec.skew * hot)
        for name, fan_in in (("gate_proj", D), ("up_proj", D), ("down_proj", I)):
            p = getattr(moe.experts, name)
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        for p in moe.shared_experts.parameters() if moe.shared_experts is not None else []:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    dtype = DTYPES[spec.dtype]
    moe.experts.to(dtype)
    if moe.shared_experts is not None:
        moe.shared_experts.to(dtype)
    x = torch.randn(spec.world, spec.tokens, D, generator=gen).to(dtype)
    grad = torch.randn(spec.world, spec.tokens, D, generator=gen)
    return moe, x, grad


def layer_worker(rank: int, world: int, spec: LayerSpec) -> dict | None:
    """EP forward + backward of rank ``rank``'s tokens; rank 0 returns the comparison with one process."""
    torch.manual_seed(spec.seed)
    moe, x_all, g_all = build_layer(spec)
    reference = copy.deepcopy(moe) if rank == 0 else None
    groups = make_ep_groups(spec.gpus_per_node)
    first = None if spec.move_to_placement else spec.placement()
    ep = make_expert_parallel(moe, groups, first, spec.dispatch, spec.combine).train()
    if spec.move_to_placement:
        set_placement(ep, spec.placement())
    if spec.fp8:
        _apply_fp8(ep, reference)

    x = x_all[rank : rank + 1].clone().requires_grad_()
    y = ep(x)
    loss = (y.float() * g_all[rank : rank + 1]).sum() + ep.aux_loss / world
    start = time.perf_counter()
    loss.backward()
    backward_s = time.perf_counter() - start
    stages = dict(ep.dispatcher.stage_seconds)

    gathered = _gather_results(ep, x, y, world)
    assignments = torch.tensor([int((ep.dispatcher.last_expert_slots >= 0).sum())])
    per_rank = [torch.empty_like(assignments) for _ in range(world)]
    dist.all_gather(per_rank, assignments)
    traffic = _traffic(ep, spec, groups.layout, rank)
    overlap = _overlap(ep, x_all[rank : rank + 1], spec.overlap_repeats) if spec.overlap_repeats else None
    times = _gather_floats({**stages, "backward": backward_s}, world)
    if rank != 0:
        return None
    ref = _reference(reference, x_all, g_all)
    result = {
        "spec": asdict(spec),
        **_compare(gathered, ref),
        **traffic,
        "times": times,
        "without_node_limit": _unlimited_copies(reference, x_all, spec, groups.layout),
        "assignments_per_rank": torch.cat(per_rank).tolist(),
    }
    if overlap is not None:
        result["overlap"] = overlap
    return result


def _apply_fp8(ep: MoE, reference: MoE | None) -> None:
    """The trainer's FP8 recipe, applied after the sharding as the trainer does: the shard's experts must
    become FP8 experts (they once stayed in high precision under EP)."""
    from dsv3.model.experts import FP8Experts
    from dsv3.train.precision import apply_fp8

    apply_fp8(ep)
    if reference is not None:
        apply_fp8(reference)
    if not isinstance(ep.experts, FP8Experts):
        raise DSV3Error(f"the expert-parallel layer computes with {type(ep.experts).__name__}, not FP8Experts")


def layers_worker(rank: int, world: int, specs: list[LayerSpec]) -> list[dict | None]:
    """Several layer checks in one launch (process start-up dominates on a small machine)."""
    return [layer_worker(rank, world, spec) for spec in specs]


def _gather_results(ep: MoE, x: torch.Tensor, y: torch.Tensor, world: int) -> dict:
    """Outputs, input grads, logical expert grads, summed replicated grads, global aux loss and load."""
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y.detach().contiguous())
    gxs = [torch.empty_like(x.grad) for _ in range(world)]
    dist.all_gather(gxs, x.grad.contiguous())
    expert_grads = {}
    for name, p in ep.experts.named_parameters():
        buf = torch.zeros(ep.n_experts, *p.shape[1:])  # replicas each hold their tokens' share: sum them
        buf.index_add_(0, ep.dispatcher.expert_ids, p.grad.float())
        dist.all_reduce(buf)
        expert_grads[name] = buf
    dense = {"gate.weight": ep.gate.weight.grad.clone()}
    if ep.shared_experts is not None:
        dense.update({f"shared.{n}": p.grad.float().clone() for n, p in ep.shared_experts.named_parameters()})
    for g in dense.values():
        dist.all_reduce(g)
    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    load = ep.expert_load.clone()  # this rank's tokens: the trainer sums the loads over ranks, as here
    dist.all_reduce(load)
    return {
        "y": torch.cat(ys),
        "gx": torch.cat(gxs),
        "experts": expert_grads,
        "dense": dense,
        "aux": float(aux) / world,
        "load": load,
    }


def global_load(spec: LayerSpec) -> torch.Tensor:
    """Tokens per logical expert over every rank's inputs (what EPLB plans from); no processes needed."""
    moe, x_all, _ = build_layer(spec)
    with torch.no_grad():
        idx = moe.gate(x_all.reshape(-1, spec.hidden).float())[0]
    return torch.bincount(idx.flatten(), minlength=spec.experts).double()


def rank_assignments(spec: LayerSpec, placement: Placement) -> torch.Tensor:
    """Token-expert assignments each rank would process under ``placement`` [W] (from routing alone)."""
    moe, x_all, _ = build_layer(spec)
    totals = torch.zeros(spec.world, dtype=torch.long)
    with torch.no_grad():
        for r in range(spec.world):
            slots = placement.choose_slots(moe.gate(x_all[r].float())[0], salt=r)
            totals += torch.bincount((slots // placement.slots_per_rank).flatten(), minlength=spec.world)
    return totals


def _reference(moe: MoE, x_all: torch.Tensor, g_all: torch.Tensor) -> dict:
    moe.train()
    x = x_all.clone().requires_grad_()
    y = moe(x)
    ((y.float() * g_all).sum() + moe.aux_loss).backward()
    dense = {"gate.weight": moe.gate.weight.grad}
    if moe.shared_experts is not None:
        dense.update({f"shared.{n}": p.grad.float() for n, p in moe.shared_experts.named_parameters()})
    return {
        "y": y.detach(),
        "gx": x.grad,
        "dense": dense,
        "aux": float(moe.aux_loss.detach()),
        "load": moe.expert_load,
        "experts": {n: p.grad.float() for n, p in moe.experts.named_parameters()},
    }


def _compare(ep: dict, ref: dict) -> dict:
    def diff(a, b):
        return float((a.float() - b.float()).abs().max())

    def scale(a):
        return float(a.float().abs().max())

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))

    grads = {"x": (ep["gx"], ref["gx"])}
    grads.update({f"experts.{n}": (ep["experts"][n], ref["experts"][n]) for n in ref["experts"]})
    grads.update({n: (ep["dense"][n], ref["dense"][n]) for n in ref["dense"]})
    return {
        "max_abs_diff_vs_single": diff(ep["y"], ref["y"]),
        "max_abs_single": scale(ref["y"]),
        "grad_max_abs_diff": {n: diff(a, b) for n, (a, b) in grads.items()},
        "grad_max_abs": {n: scale(b) for n, (_, b) in grads.items()},
        "output_rel_error": rel(ep["y"], ref["y"]),
        "grad_rel_error": {n: rel(a, b) for n, (a, b) in grads.items()},
        "aux_loss_diff": abs(ep["aux"] - ref["aux"]),
        "expert_load_equal": bool(torch.equal(ep["load"], ref["load"])),
    }


def _traffic(ep: MoE, spec: LayerSpec, layout: NodeLayout, rank: int) -> dict:
    """Measured bytes (summed over ranks) next to the analytic bytes and per-token copy statistics."""
    d: ExpertParallelDispatcher = ep.dispatcher
    counts = copy_counts(d.last_slots, layout, rank, d.placement.slots_per_rank)
    f, dim = d.formats, spec.hidden
    analytic = analytic_bytes(
        counts,
        spec.topk,
        f.dispatch.row_bytes(dim),
        f.combine_intra.row_bytes(dim),
        f.combine_inter.row_bytes(dim),
    )
    keys = sorted(set(analytic) | set(d.meter.bytes))
    both = torch.tensor([[d.meter.bytes.get(k, 0), analytic.get(k, 0)] for k in keys], dtype=torch.float64)
    dist.all_reduce(both)
    measured = {"/".join(k): int(v) for k, v in zip(keys, both[:, 0].tolist(), strict=True)}
    expected = {"/".join(k): int(v) for k, v in zip(keys, both[:, 1].tolist(), strict=True)}
    per_token = torch.stack([counts.nodes, counts.inter, counts.naive_inter, counts.intra], 1)
    everyone = [torch.empty_like(per_token) for _ in range(layout.world)]
    dist.all_gather(everyone, per_token)
    nodes, inter, naive, intra = torch.cat(everyone).float().unbind(1)

    def fwd(level, kinds=("dispatch", "combine")):
        return sum(measured.get(f"forward/{level}/{k}", 0) for k in kinds)

    return {
        "mean_inter_node_copies_per_token": float(inter.mean()),
        "max_inter_node_copies_per_token": int(inter.max()),
        "mean_nodes_per_token": float(nodes.mean()),
        "max_nodes_per_token": int(nodes.max()),
        "mean_inter_node_copies_without_dedup": float(naive.mean()),
        "max_inter_node_copies_without_dedup": int(naive.max()),
        "mean_intra_node_copies_per_token": float(intra.mean()),
        "node_limit": d.node_limit(ep.gate),
        "inter_node_bytes": fwd("inter"),
        "intra_node_bytes": fwd("intra"),
        "inter_node_metadata_bytes": fwd("inter", ("gate", "slots")),
        "intra_node_metadata_bytes": fwd("intra", ("gate", "slots")),
        "bytes_per_token_row": {
            "dispatch": f.dispatch.row_bytes(spec.hidden),
            "combine_inter": f.combine_inter.row_bytes(spec.hidden),
            "combine_intra": f.combine_intra.row_bytes(spec.hidden),
        },
        "traffic_measured": measured,
        "traffic_analytic": expected,
        "traffic_matches_analytic": measured == expected,
    }


def _unlimited_copies(moe: MoE, x_all: torch.Tensor, spec: LayerSpec, layout: NodeLayout) -> dict:
    """The same tokens routed without the node limit (topk_group = all nodes): copies per token."""
    gate = copy.deepcopy(moe.gate)
    gate.topk_group = gate.n_group
    placement = spec.placement() or Placement.contiguous(spec.experts, spec.world)
    inter, naive = [], []
    with torch.no_grad():
        for r in range(spec.world):
            idx = gate(x_all[r].float())[0]
            c = copy_counts(placement.choose_slots(idx, salt=r), layout, r, placement.slots_per_rank)
            inter.append(c.inter)
            naive.append(c.naive_inter)
    inter, naive = torch.cat(inter).float(), torch.cat(naive).float()
    return {
        "mean_inter_node_copies_per_token": float(inter.mean()),
        "max_inter_node_copies_per_token": int(inter.max()),
        "mean_inter_node_copies_without_dedup": float(naive.mean()),
        "max_inter_node_copies_without_dedup": int(naive.max()),
    }


def _gather_floats(values: dict[str, float], world: int) -> dict[str, dict[str, float]]:
    """Per-stage seconds: mean and max over ranks."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    everyone = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(everyone, t)
    stacked = torch.stack(everyone)
    return {
        k: {"mean_s": float(stacked[:, i].mean()), "max_s": float(stacked[:, i].max())}
        for i, k in enumerate(keys)
    }


def _overlap(ep: MoE, x: torch.Tensor, repeats: int) -> dict:
    """Two micro-batches (the rank's tokens and a perturbed copy): forward one after the other vs
    overlapped. Hidden fraction = time saved / communication time of the sequential run."""
    ep.eval()
    xs = [x, x.flip(1)]
    seq, ovl, comm = [], [], []
    with torch.no_grad():
        for _ in range(repeats):
            stages = ep.dispatcher.stage_seconds
            stages.clear()
            dist.barrier()
            start = time.perf_counter()
            outs_seq = [ep(xi) for xi in xs]
            seq.append(time.perf_counter() - start)
            comm.append(stages["dispatch"] + stages["combine"])
            dist.barrier()
            start = time.perf_counter()
            outs_ovl = forward_micro_batches(ep, xs)
            ovl.append(time.perf_counter() - start)
    diff = max(float((a - b).abs().max()) for a, b in zip(outs_seq, outs_ovl, strict=True))
    t = torch.tensor(
        [statistics.median(seq), statistics.median(ovl), statistics.median(comm), diff], dtype=torch.float64
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seq_s, ovl_s, comm_s, diff = t.tolist()
    return {
        "sequential_s": seq_s,
        "overlapped_s": ovl_s,
        "communication_s": comm_s,
        "hidden_fraction": max(0.0, seq_s - ovl_s) / comm_s if comm_s > 0 else 0.0,
        "max_abs_diff_overlapped_vs_sequential": diff,
    }


# ---- training ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSpec:
    gpus_per_node: int = 2
    steps: int = 3
    seq_len: int = 8
    seqs_per_rank: int = 1
    dispatch: str = "bf16"
    combine: str = "bf16"
    lr: float = 1e-2
    seed: int = 0
    micro_batches: int = 1  # > 1: each rank's sequences in that many micro-batches (gradient accumulation)
    precision: str | None = None  # set: build the EP model with the trainer's own build_model (wire formats
    # then follow the precision, as in `dsv3 train --ep N --precision P`); the reference gets its numerics


def tiny_config(nodes: int) -> ModelConfig:
    """Two layers (one MoE) with one expert group per node, MTP on: small enough for 8 CPU processes."""
    return ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=nodes,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        max_position_embeddings=64,
        rope_scaling=None,
        torch_dtype="float32",
        bias_update_speed=0.01,
        aux_loss_alpha=1e-2,
    ).validate()


def train_worker(rank: int, world: int, spec: TrainSpec) -> dict | None:
    """A few AdamW steps of a tiny Transformer with EP (each rank its own sequences) and, on rank 0, the
    same steps in one process on all sequences. Returns both loss curves and the router-bias gap."""
    from dsv3.model.transformer import Transformer

    cfg = tiny_config(world // spec.gpus_per_node)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg)
    reference = copy.deepcopy(model) if rank == 0 else None
    if spec.precision is None:
        layout = Layout(dp=world, ep=world, gpus_per_node=spec.gpus_per_node, dispatch=spec.dispatch,
                        combine=spec.combine)
        parallel = parallelize(model, layout)
    else:
        parallel, reference = _as_the_trainer_builds_it(cfg, spec, rank, world, reference)
        model = parallel.model
    expert_calls = []  # the experts modules must really run (not be bypassed by the dispatcher)
    for m in model.moe_layers():
        m.experts.register_forward_hook(lambda *_: expert_calls.append(1))
    # one fixed batch, seen every step: the loss must fall (memorization), in both runs alike
    data = torch.randint(
        0,
        cfg.vocab_size,
        (1, world * spec.seqs_per_rank, spec.seq_len + 1),
        generator=torch.Generator().manual_seed(spec.seed + 1),
    ).expand(spec.steps, -1, -1)
    mine = slice(rank * spec.seqs_per_rank, (rank + 1) * spec.seqs_per_rank)
    losses = _train(model, data[:, mine], spec, parallel)
    if rank != 0:
        return None
    ref_losses = _train(reference, data, spec, None)
    bias = [m.gate.e_score_correction_bias for m in ep_layers(model)]
    ref_bias = [m.gate.e_score_correction_bias for m in reference.moe_layers()]
    return {
        "expert_kinds": sorted({type(m.experts).__name__ for m in model.moe_layers()}),
        "expert_forward_calls": len(expert_calls),
        "ep_losses": losses,
        "single_losses": ref_losses,
        "bias_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(bias, ref_bias, strict=True)),
        "bias_max_abs": max(float(b.abs().max()) for b in ref_bias),
    }


def _as_the_trainer_builds_it(cfg: ModelConfig, spec: TrainSpec, rank: int, world: int, reference):
    """`dsv3 train --ep WORLD --precision P`'s model (its build_model, same seed) and the single-process
    reference with the same numerics."""
    from dsv3.model.init import seeded_values
    from dsv3.model.transformer import Transformer
    from dsv3.parallel.materialize import materialize
    from dsv3.train.distributed import World
    from dsv3.train.options import TrainOptions
    from dsv3.train.precision import apply_fp8
    from dsv3.train.run import build_model

    opts = TrainOptions(precision=spec.precision, ep=world, gpus_per_node=spec.gpus_per_node, seed=spec.seed)
    parallel = build_model(cfg, opts, World(rank, world, rank, torch.device("cpu")))
    if reference is not None:  # the trainer's fresh values: each tensor seeded by its name
        with torch.device("meta"):
            reference = Transformer(cfg)
        materialize(reference, torch.device("cpu"), seeded_values(cfg.initializer_range, spec.seed))
        if spec.precision == "fp8":
            apply_fp8(reference)
    return parallel, reference


def trains_worker(rank: int, world: int, specs: list[TrainSpec]) -> list[dict | None]:
    """Several training comparisons in one launch."""
    return [train_worker(rank, world, spec) for spec in specs]


def _accumulate(parallel, batch: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """Backward of the batch's mean loss in ``micro_batches`` parts, the gradient sync skipped for all but
    the last (as the trainer's --grad-accum does); returns the detached mean loss."""
    total = torch.zeros(())
    parts = batch.chunk(micro_batches)
    for j, part in enumerate(parts):
        with contextlib.nullcontext() if j == len(parts) - 1 else parallel.no_sync():
            loss, _ = parallel(part[:, :-1], part[:, 1:])
            (loss / len(parts)).backward()
        total += loss.detach() / len(parts)
    return total


def _train(model, data: torch.Tensor, spec: TrainSpec, parallel) -> list[float]:
    """AdamW steps on ``data``; through ``parallel`` (a `Parallelized`) when given, as the trainer does."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    losses = []
    for step in range(spec.steps):
        batch = data[step]
        opt.zero_grad(set_to_none=True)
        if parallel is None:
            loss = model.loss(batch[:, :-1], batch[:, 1:]).loss
            loss.backward()
        else:
            loss = _accumulate(parallel, batch, spec.micro_batches)
            parallel.sync_and_clip(float("inf"))
            parallel.reduce_expert_loads()
            loss = parallel.sum_(loss.detach().clone()) / parallel.world
        opt.step()
        model.update_router_biases()
        losses.append(float(loss))
    return losses
