"""`dsv3 plan train`: per-GPU memory and step time of a V3-style training layout, and a layout search.

Every number comes from counts (parameters, FLOPs and bytes per token from `params`/`flops`, traffic per
token from the network package's router and flow simulator) divided by rates (hardware peaks times a
stated efficiency per op class, link bandwidths times a stated protocol efficiency). Two efficiencies
are fitted once to the ISCA paper's Table 4 (arXiv 2505.09343) and then held fixed for every other
prediction; everything else is a stated, adjustable assumption (see docs/plan.md).

The step is broken down in Table 4's own terms: forward-only chunks (1F), backward-only chunks (1B),
weight-gradient-only chunks (1W), the overlapped forward-backward pairs (the "1F1B" part), the pipeline
bubble, and the optimizer (ZeRO-1 gradient reduce-scatter, update and parameter all-gather).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np

from dsv3.analysis.arch import Architecture
from dsv3.analysis.flops import attention_macs_per_key, train_flops_per_token
from dsv3.analysis.hardware import Hardware
from dsv3.analysis.params import count_params, router_params, swiglu_params
from dsv3.errors import DSV3Error
from dsv3.layout import PLANNED_SCHEDULES, SHARDINGS, STAGES_PER_RANK, Layout, pipeline_bubble

GB = 1e9
# The schedules whose step this model prices (Table 4's bidirectional DualPipe first): the trainer runs
# dualpipev and 1f1b; it also runs interleaved and zbv, which the planner does not price.
MODELLED_SCHEDULES = ("dualpipe", "dualpipev", "1f1b")
COMBINE_FORMATS = {"bf16": 2.0, "fp8": 1.0 + 4 / 128, "logfmt10": 10 / 8 + 4 / 128}
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "none": 0.0}

# ISCA Table 4 (MPFT column): V3 on 2,048 H800s, 15,360 x 4,096 tokens per step.
TABLE4 = {"step_s": 19.926, "1F_s": 1.13, "bubble_s": 2.06, "1B_s": 1.99, "1W_s": 0.48, "1F1B_s": 13.95,
          "opt_s": 0.29, "tokens_per_day": 272.80e9}
V3_PRETRAIN_TOKENS = 14.8e12
V3_PRETRAIN_GPU_HOURS = 2.664e6


@dataclass(frozen=True)
class Assumptions:
    """Rates and overlaps the model cannot derive from counts. `FITTED` names the three fitted to Table 4."""

    gemm_efficiency: float = 0.156  # FITTED: achieved / peak for the linear layers (FP8 peak when FP8)
    attention_efficiency: float = 0.325  # FITTED: achieved / BF16 peak for the attention core (fwd and bwd)
    total_sms: int = 132  # H800
    comm_sms: int = 20  # V3 gave 20 of 132 SMs to communication; compute runs on the rest
    nic_efficiency: float = 0.8  # 40 of 50 GB/s achieved by EP all-to-all (ISCA §4.3)
    nvlink_efficiency: float = 0.8  # 160 of 200 GB/s achievable (ISCA §4.1)
    pair_overlap: float = 1.0  # share of an overlapped F&B pair's communication hidden under its compute
    forward_alone_overlap: float = 0.461  # FITTED: share of a forward-only chunk's all-to-all hidden (under its
    # shared expert and attention); backward-only chunks hide none
    micro_batch_seqs: int = 1  # sequences per pipeline micro-batch
    grad_reduce_bytes: float = 2.0  # gradients are reduce-scattered in BF16
    optimizer_hbm_efficiency: float = 0.7  # the AdamW update streams its state through HBM
    reserve_gb: float = 3.0  # CUDA context, allocator fragmentation, communication buffers
    node_limit: int = 4  # V3: a token's experts sit on at most M = 4 nodes (0 = no limit)

    FITTED = ("gemm_efficiency", "attention_efficiency", "forward_alone_overlap")

    def check(self) -> None:
        for name in ("gemm_efficiency", "attention_efficiency", "nic_efficiency", "nvlink_efficiency",
                     "optimizer_hbm_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise DSV3Error(f"{name.replace('_', '-')} must be in (0, 1], got {value}")
        for name in ("pair_overlap", "forward_alone_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise DSV3Error(f"{name.replace('_', '-')} must be in [0, 1]")
        if not 0 <= self.comm_sms < self.total_sms:
            raise DSV3Error("comm-sms must be >= 0 and below the SM count")
        if self.micro_batch_seqs < 1:
            raise DSV3Error("micro-batch must be >= 1 sequence")


@dataclass(frozen=True)
class Knobs:
    """The ISCA paper's hardware proposals (§4-§6) as inputs of the model. None = the hardware preset's."""

    nvlink_gbs: float | None = None  # scale-up GB/s per GPU per direction (link rate; x nvlink_efficiency)
    nic_gbps: float | None = None  # scale-out Gb/s per GPU per direction
    scale_up_domain: int | None = None  # GPUs sharing one NVLink domain (8 for H800; 72 for an NVL72 rack)
    multicast: bool = False  # in-network multicast for dispatch: one copy leaves the sender per token
    in_network_reduce: bool = False  # in-network reduction for combine: one copy arrives per token
    combine_format: str = "bf16"  # bf16 | fp8 | logfmt10
    sm_offload: bool = False  # communication off the SMs: no SMs lost to it

    def check(self) -> None:
        if self.combine_format not in COMBINE_FORMATS:
            raise DSV3Error(f"combine format must be one of {', '.join(COMBINE_FORMATS)}, got {self.combine_format!r}")
        for name, value in (("nvlink-GBps", self.nvlink_gbs), ("nic-gbps", self.nic_gbps)):
            if value is not None and not value > 0:
                raise DSV3Error(f"--{name} must be positive, got {value}")
        if self.scale_up_domain is not None and self.scale_up_domain < 1:
            raise DSV3Error("--scale-up-domain must be >= 1")


def planned_layout(gpus: int, pp: int, ep: int, dp_shard: str = "zero1", schedule: str = "dualpipe",
                   tp: int = 1) -> Layout:
    """The `dsv3.layout.Layout` the planner reasons about: ``pp`` x ``tp`` x DP = ``gpus``, DP from the
    cluster (`check_layout` refuses a remainder). The defaults are Table 4's: ZeRO-1 and the bidirectional
    DualPipe."""
    return Layout(pp=pp, dp=max(1, gpus // max(1, pp * tp)), ep=ep, dp_shard=dp_shard, tp=tp, schedule=schedule)


def label(layout: Layout) -> str:
    """The planner's short name of a layout, e.g. ``PP16 dualpipe EP64 zero1``."""
    tp = f" TP{layout.tp}" if layout.tp > 1 else ""
    return f"PP{layout.pp} {layout.schedule} EP{layout.ep}{tp} {layout.dp_shard}"


def model_stages(layout: Layout) -> int:
    """Pipeline stages the model is cut into: ``2 pp`` under DualPipeV's V (and interleaved 1F1B), else
    ``pp`` (DualPipe's ranks hold two stages each, one of each of the model's two copies)."""
    return layout.pp if layout.schedule == "dualpipe" else layout.pp * STAGES_PER_RANK[layout.schedule]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each copy the training run keeps (V3: BF16 weights, FP32 master and grads, BF16
    moments, FP8 GEMMs)."""

    compute: str = "fp8"  # fp8 | bf16: which peak the linear layers run at
    weights: str = "bf16"
    master: str = "fp32"
    grads: str = "fp32"
    moments: str = "bf16"

    def check(self) -> None:
        if self.compute not in ("fp8", "bf16"):
            raise DSV3Error(f"--compute must be fp8 or bf16, got {self.compute!r}")
        for name in ("weights", "master", "grads", "moments"):
            value = getattr(self, name)
            if value not in DTYPE_BYTES or (value == "none" and name != "master"):
                raise DSV3Error(f"--{name} must be one of fp32, bf16, fp8" + (", none" if name == "master" else "")
                                + f"; got {value!r}")


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    gpus: int
    network: str = "mpft"
    knobs: Knobs = field(default_factory=Knobs)

    @property
    def domain(self) -> int:
        return self.knobs.scale_up_domain or self.hardware.scale_up_domain or 1

    def nic_bytes_s(self, a: Assumptions) -> float:
        gbps = self.knobs.nic_gbps if self.knobs.nic_gbps is not None else self.hardware.scale_out_gbs * 8
        return gbps / 8 * GB * a.nic_efficiency

    def nvlink_bytes_s(self, a: Assumptions) -> float:
        """Scale-up rate; a device without a scale-up domain talks to its peers over its NIC."""
        gbs = self.knobs.nvlink_gbs if self.knobs.nvlink_gbs is not None else self.hardware.scale_up_gbs
        if self.domain <= 1 or gbs <= 0:
            return self.nic_bytes_s(a)
        return gbs * GB * a.nvlink_efficiency

    def compute_share(self, a: Assumptions) -> float:
        """Fraction of the SMs left to compute: all of them when communication is offloaded."""
        return 1.0 if self.knobs.sm_offload else (a.total_sms - a.comm_sms) / a.total_sms


# ---- the model's pieces in counts -----------------------------------------------------------------

@dataclass(frozen=True)
class ModelCounts:
    """Per-layer parameter and FLOP counts the planner needs, derived from `params` and `flops`."""

    layers: int  # main-model layers + MTP modules, as pipeline stages see them
    moe_layers: int
    non_expert_params: float  # everything but the routed experts, MTP included
    expert_params: float  # routed experts of all MoE layers, MTP included
    embedding_params: float
    fp8_matmul_per_token: float  # activated matmul weights that run in FP8 (projections, experts, FFNs)
    bf16_matmul_per_token: float  # output head(s) and router: BF16 in V3's recipe
    attention_macs_per_key: float  # all layers incl. MTP

    @property
    def total_params(self) -> float:
        return self.non_expert_params + self.expert_params


def model_counts(arch: Architecture) -> ModelCounts:
    """Counts including the MTP modules (they are trained, so they cost memory and time)."""
    c = count_params(arch)
    mtp = arch.mtp_layers
    moe_layers = len(arch.moe_layers) + (mtp if arch.mtp_is_moe else 0)
    routed = 0.0
    if arch.is_moe:
        routed = moe_layers * arch.moe.n_routed * swiglu_params(arch, arch.moe.expert_intermediate).total
    total = c.total_params + c.mtp_total
    head = arch.vocab_size * arch.hidden_size
    router = router_params(arch).matmul * moe_layers if arch.is_moe else 0
    matmul = c.matmul_active + c.mtp_matmul_active
    bf16 = head * (1 + mtp) + router
    return ModelCounts(
        layers=arch.num_layers + mtp, moe_layers=moe_layers, non_expert_params=total - routed,
        expert_params=routed, embedding_params=c.total["embedding"], fp8_matmul_per_token=matmul - bf16,
        bf16_matmul_per_token=bf16, attention_macs_per_key=attention_macs_per_key(arch) * (arch.num_layers + mtp)
        / arch.num_layers,
    )


def activation_bytes_per_token(arch: Architecture) -> dict[str, float]:
    """Bytes one token leaves behind for the backward pass, per layer kind, under V3's recipe.

    Stored: the layer input in BF16 and its FP8 copy (RMSNorm and the MLA up-projections are recomputed),
    the MLA latents, the attention output; per routed copy and for the shared expert the FP8 expert input
    and the FP8 SwiGLU input (its output is recomputed).
    """
    a, d = arch.attention, arch.hidden_size
    if a.kind == "mla":
        attn = 3 * d + 2 * ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim)
    else:
        attn = 3 * d + 2 * (a.num_kv_heads * (a.qk_head_dim + a.v_head_dim) + a.num_heads * a.qk_head_dim)
    attn += 1.5 * a.num_heads * a.v_head_dim + 4 * a.num_heads  # E5M6 attention output
    dense = 3 * d + 2 * arch.dense_intermediate
    moe = 0.0
    if arch.is_moe:
        per_copy = d + 2 * arch.moe.expert_intermediate
        moe = 3 * d + arch.moe.top_k * per_copy + (d + 2 * arch.moe.shared_intermediate if arch.moe.n_shared else 0)
    return {"attention": float(attn), "dense_ffn": float(dense), "moe_ffn": float(moe)}


# ---- expert-parallel traffic ----------------------------------------------------------------------

@dataclass(frozen=True)
class EPTraffic:
    """Copies of one token that leave its GPU in one dispatch (the combine mirrors it)."""

    nic_copies: float  # copies crossing the scale-out network (one per remote node: node-level dedup)
    nvlink_copies: float  # copies over the scale-up domain (local experts and the forwarding hop)
    nodes_per_group: int
    node_limit: int | None


@lru_cache(maxsize=64)
def ep_traffic(experts: int, top_k: int, ep: int, domain: int, node_limit: int, seed: int = 0) -> EPTraffic:
    """Copies per token from the network package's router (group-limited top-k, DeepEP-style dedup)."""
    from dsv3.network.moe import EPSpec, ep_workload

    if ep <= 1:
        return EPTraffic(0.0, 0.0, 1, None)
    if ep <= domain:  # the whole EP group shares one scale-up domain: every copy goes over NVLink
        distinct = ep * (1 - (1 - 1 / ep) ** top_k)  # GPUs hit by top_k experts placed at random
        return EPTraffic(0.0, distinct * (ep - 1) / ep, 1, None)
    if ep % domain or experts % ep:
        raise DSV3Error(f"EP {ep} must be a multiple of the scale-up domain ({domain} GPUs) and divide the "
                        f"{experts} routed experts")
    spec = EPSpec(tokens_per_gpu=64, hidden=128, experts=experts, topk=top_k, node_limit=node_limit, ep_size=ep)
    work = ep_workload(ep, domain, spec, "dispatch", seed)
    for _ in work.chunks():
        pass
    info = work.info
    nic = info["ib_copies_per_token"]
    return EPTraffic(nic, max(0.0, info["gpus_per_token"] - nic), ep // domain, info["node_limit"])


@lru_cache(maxsize=32)
def fabric_factor(network: str, ep: int, domain: int, nic_gbps: float) -> float:
    """Mean achieved / line rate of the NICs in an EP dispatch on this topology, from the flow simulator.

    The scale-up links are made infinitely fast here (the planner prices them separately), so the factor
    is the network's alone: the uneven load of the busiest NIC on a non-blocking fat tree (about 0.94 at
    EP64), less on an oversubscribed fabric. Latency is left out (megabytes per GPU per all-to-all).
    """
    from dsv3.network.catalog import KINDS, TopologySpec
    from dsv3.network.fabric import LinkSpeeds
    from dsv3.network.moe import EPSpec
    from dsv3.network.simulate import SimConfig, run_simulation

    if network not in KINDS:
        raise DSV3Error(f"unknown topology {network!r}; choose one of {', '.join(KINDS)}")
    if ep <= domain or ep % domain:
        return 1.0
    cfg = SimConfig(topology=TopologySpec(kind=network, endpoints=ep, gpus_per_node=domain), traffic="ep-dispatch",
                    speeds=LinkSpeeds(nic_gbps, None, 1e6), ep=EPSpec(tokens_per_gpu=256, ep_size=ep),
                    rtol=1e-2)
    rep = run_simulation(cfg)
    return max(1e-3, min(1.0, rep["nic"]["tx_GBps_mean"] / rep["nic"]["line_rate_GBps"]))


def token_bytes(arch: Architecture, knobs: Knobs) -> tuple[float, float]:
    """(dispatch, combine) bytes per token copy: FP8 with one fp32 scale per 128, and the combine format."""
    d = arch.hidden_size
    return d + 4 * math.ceil(d / 128), d * COMBINE_FORMATS[knobs.combine_format]


def ep_phase_seconds(tokens: float, arch: Architecture, cluster: Cluster, layout: Layout, a: Assumptions,
                     phases: int = 1) -> float:
    """Seconds for `tokens` per GPU to go through dispatch + combine `phases` times, overlapped in pairs.

    NIC time is the busier direction: with multicast the sender puts one copy per token on its uplink
    (the receivers still take one per node); with in-network reduction one copy per token arrives back
    (the senders still send one per node). The scale-up part is checked the same way.
    """
    if not arch.is_moe or layout.ep <= 1:
        return 0.0
    k = cluster.knobs
    t = ep_traffic(arch.moe.n_routed, arch.moe.top_k, layout.ep, cluster.domain, _node_limit(a, layout, cluster))
    disp, comb = token_bytes(arch, k)
    c = t.nic_copies
    one = min(c, 1.0)
    tx = tokens * ((one if k.multicast else c) * disp + c * comb)
    rx = tokens * (c * disp + (one if k.in_network_reduce else c) * comb)
    nic_rate = cluster.nic_bytes_s(a) * _fabric(cluster, layout.ep)
    nic_s = max(tx, rx) / nic_rate if c > 0 else 0.0
    nvl_s = tokens * t.nvlink_copies * (disp + comb) / cluster.nvlink_bytes_s(a)
    return phases * max(nic_s, nvl_s)


def _fabric(cluster: Cluster, ep: int) -> float:
    hw, k = cluster.hardware, cluster.knobs
    nic = k.nic_gbps if k.nic_gbps is not None else hw.scale_out_gbs * 8
    return fabric_factor(cluster.network, ep, cluster.domain, nic)


def _node_limit(a: Assumptions, layout: Layout, cluster: Cluster) -> int:
    """Node-limited routing (V3: M = 4): applies when the EP group spans more nodes than the limit."""
    return a.node_limit if 0 < a.node_limit < layout.ep // cluster.domain else 0


# ---- the pipeline schedules -------------------------------------------------------------------------

def dualpipe_ops(pp: int, chunks: int, half_rank: int) -> dict[str, int]:
    """Counts of each kind of chunk one rank runs in DualPipe's step (DualPipe's README schedule).

    F: forward alone; B: full backward alone; Bi: input-gradient backward alone (its W runs later);
    W: weight-gradient alone; FB: an overlapped forward + full backward pair.
    """
    half, h = pp // 2, half_rank
    ops = {"F": 0, "B": 0, "Bi": 0, "W": 0, "FB": 0}
    ops["F"] += 2 * (half - h - 1) + 2 * (h + 1)  # steps 1, 2
    ops["Bi"] += half - h - 1  # step 3: B1 (zero bubble), W1, F1
    ops["W"] += half - h - 1
    ops["F"] += half - h - 1
    ops["FB"] += 2 * (chunks // 2 - pp + h + 1)  # step 4: the main loop
    ops["B"] += half - h - 1  # step 5: B1, then an F1&B0 pair
    ops["FB"] += half - h - 1
    step6 = h + 1  # step 6: the second half of its backwards leave W for later
    zb1 = sum((i > step6 // 2) or (i == step6 // 2 and h % 2 == 1) for i in range(step6))
    zb0 = sum(i >= step6 // 2 for i in range(step6))
    ops["Bi"] += zb1 + zb0
    ops["B"] += 2 * step6 - zb1 - zb0
    ops["W"] += zb1 + zb0  # step 8 runs these deferred weight chunks
    ops["Bi"] += half - h - 1  # step 7: W, then B0 (zero bubble)
    ops["W"] += half - h - 1
    return ops


def schedule_ops(schedule: str, pp: int, chunks: int) -> dict[str, float]:
    """Per-rank chunk counts, averaged over the ranks (Table 4 does not say which rank it reports)."""
    if schedule == "1f1b":
        warm = (pp - 1) / 2  # rank r runs pp - 1 - r forwards before its first backward: mean (pp - 1) / 2
        return {"F": warm, "B": warm, "Bi": 0.0, "W": 0.0, "FB": 0.0, "steady": chunks - warm}
    if schedule == "dualpipev":  # every micro-batch passes each rank twice (the V), in half-size chunks
        chunks *= 2
    ranks = [dualpipe_ops(pp, chunks, h) for h in range(pp // 2)]
    out = {key: float(np.mean([r[key] for r in ranks])) for key in ranks[0]}
    out["steady"] = 0.0
    return out


# ---- memory ---------------------------------------------------------------------------------------

def _stage_split(counts: ModelCounts, stages: int) -> list[int]:
    """Layers per pipeline stage, the embedding and the output head each counted as one layer's worth of
    work (the head's GEMM costs about as much as a layer), the first stages taking any remainder."""
    units = counts.layers + 2
    base, extra = divmod(units, stages)
    split = [base + (1 if s < extra else 0) for s in range(stages)]
    split[0] -= 1
    split[-1] -= 1
    return split


def _busiest_rank(arch: Architecture, counts: ModelCounts, layout: Layout) -> tuple[float, float]:
    """(non-expert parameters, layers) of the rank holding the most: in both DualPipe variants rank r holds
    stages r and (stages - 1 - r), so rank 0 carries the embedding and the head with the MTP module."""
    two_chunks = layout.schedule in ("dualpipe", "dualpipev")
    stages = model_stages(layout)
    split = _stage_split(counts, stages)
    tables = counts.embedding_params * (1 if arch.tie_word_embeddings else 2)
    layer_ne = (counts.non_expert_params - tables) / counts.layers
    layer_ex = counts.expert_params / max(counts.moe_layers, 1)

    def held_by(r: int) -> tuple[float, float]:
        held = [r, stages - 1 - r] if two_chunks else [r]
        layers = sum(split[s] for s in held)
        tabs = (counts.embedding_params if 0 in held else 0) + \
            (tables - counts.embedding_params if stages - 1 in held else 0)
        return layer_ne * layers + tabs, layers

    return max((held_by(r) for r in range(layout.pp)), key=lambda x: x[0] + layer_ex * x[1] / layout.ep)


def _activation_bytes(arch: Architecture, counts: ModelCounts, layout: Layout, seq_len: int,
                      a: Assumptions) -> float:
    """In-flight micro-batches x tokens x layers per chunk x bytes kept per token and layer."""
    act = activation_bytes_per_token(arch)
    moe_share = counts.moe_layers / counts.layers
    per_layer = act["attention"] + moe_share * act["moe_ffn"] + (1 - moe_share) * act["dense_ffn"]
    stages = model_stages(layout)
    in_flight = {"dualpipe": layout.pp + 1, "dualpipev": 2 * layout.pp + 1, "1f1b": layout.pp}[layout.schedule]
    return in_flight * a.micro_batch_seqs * seq_len * counts.layers / stages * per_layer / layout.tp


def memory_per_gpu(arch: Architecture, counts: ModelCounts, layout: Layout, dp: int, seq_len: int,
                   prec: Precision, a: Assumptions) -> dict[str, float]:
    """Bytes on the busiest GPU: its stages' weights, gradients, optimizer state and in-flight activations.

    Attention and dense layers are replicated over all DP ranks, routed experts over DP / EP of them:
    ZeRO-1 shards the optimizer state over those replicas, FSDP also the weights and gradients.
    """
    ne, layers = _busiest_rank(arch, counts, layout)
    ex = counts.expert_params / max(counts.moe_layers, 1) * counts.moe_layers / counts.layers * layers / layout.ep
    ex_dp = max(dp // layout.ep, 1)
    held = ne / dp + ex / ex_dp if layout.dp_shard == "fsdp" else ne + ex
    sharded_state = ne / dp + ex / ex_dp if layout.dp_shard in ("zero1", "fsdp") else ne + ex
    state = DTYPE_BYTES[prec.master] + 2 * DTYPE_BYTES[prec.moments]
    out = {"weights": held * DTYPE_BYTES[prec.weights] / layout.tp,
           "gradients": held * DTYPE_BYTES[prec.grads] / layout.tp,
           "optimizer": sharded_state * state / layout.tp,
           "activations": _activation_bytes(arch, counts, layout, seq_len, a),
           "reserve": a.reserve_gb * GB}
    out["total"] = sum(out.values())
    return out


# ---- time -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkTimes:
    f: float  # forward compute of one micro-batch through one chunk
    b: float  # input-gradient compute
    w: float  # weight-gradient compute
    comm: float  # EP dispatch + combine (+ FSDP weight gathers) of one chunk, forward (backward the same)
    p2p: float  # pipeline send of one micro-batch's activations
    exposed: float = 0.0  # TP all-reduces: on the critical path of each chunk, nothing hides them


def chunk_times(arch: Architecture, counts: ModelCounts, cluster: Cluster, layout: Layout, seq_len: int,
                prec: Precision, a: Assumptions) -> ChunkTimes:
    hw = cluster.hardware
    stages = model_stages(layout)
    tokens = a.micro_batch_seqs * seq_len
    share = cluster.compute_share(a)
    gemm_rate = hw.peak_tflops(prec.compute) * 1e12 * a.gemm_efficiency * share * layout.tp
    bf16_rate = hw.bf16_tflops * 1e12 * a.gemm_efficiency * share * layout.tp
    attn_rate = hw.bf16_tflops * 1e12 * a.attention_efficiency * share * layout.tp
    mm = tokens / stages * (2 * counts.fp8_matmul_per_token / gemm_rate + 2 * counts.bf16_matmul_per_token / bf16_rate)
    attn_fwd = tokens / stages * counts.attention_macs_per_key * seq_len / attn_rate  # causal: half of 2 x macs x S
    moe_layers_per_chunk = counts.moe_layers / stages
    comm = moe_layers_per_chunk * ep_phase_seconds(tokens / layout.tp, arch, cluster, layout, a)
    if layout.dp_shard == "fsdp":  # every chunk gathers its stage's weights again (forward and backward)
        dp = layout.dp
        ex_dp = max(dp // layout.ep, 1)
        stage_ne = counts.non_expert_params / stages / layout.tp
        stage_ex = counts.expert_params / stages / layout.ep / layout.tp
        comm += (stage_ne * (dp - 1) / dp + stage_ex * (ex_dp - 1) / ex_dp) * 2 / cluster.nic_bytes_s(a)
    exposed = 0.0
    if layout.tp > 1:  # two all-reduces per layer, ring: 2 (tp - 1) / tp of the activations each, over NVLink
        ring = 2 * (layout.tp - 1) / layout.tp
        exposed = counts.layers / stages * 2 * ring * tokens * arch.hidden_size * 2 / cluster.nvlink_bytes_s(a)
    p2p = tokens * arch.hidden_size * 2 / cluster.nic_bytes_s(a) if layout.pp > 1 else 0.0
    return ChunkTimes(f=mm / 2 + attn_fwd + exposed, b=mm / 2 + 2 * attn_fwd + exposed, w=mm / 2, comm=comm,
                      p2p=p2p, exposed=exposed)


def _pair_seconds(compute: float, comm: float, overlap: float) -> float:
    """Compute and communication of one chunk (or pair) with `overlap` of the compute able to hide comm."""
    return compute + comm - min(comm, overlap * compute)


def step_breakdown(ct: ChunkTimes, layout: Layout, chunks: int, a: Assumptions) -> dict[str, float]:
    """Seconds per step in Table 4's terms, before the optimizer."""
    ops = schedule_ops(layout.schedule, layout.pp, chunks)
    f_alone = _pair_seconds(ct.f, ct.comm, a.forward_alone_overlap) + ct.p2p
    bi_alone = ct.b + ct.comm + ct.p2p
    b_alone = ct.b + ct.w + ct.comm + ct.p2p
    w_alone = ct.w
    pair = _pair_seconds(ct.f + ct.b + ct.w, 2 * ct.comm + 2 * ct.p2p, a.pair_overlap)
    steady = f_alone + b_alone if layout.schedule == "1f1b" else 0.0
    _, bubble = pipeline_bubble(layout.schedule, layout.pp, f_alone, b_alone, w_alone, FB=pair)
    return {
        "1F": ops["F"] * f_alone,
        "1B": ops["B"] * b_alone + ops["Bi"] * bi_alone,
        "1W": ops["W"] * w_alone,
        "1F1B": ops["FB"] * pair + ops["steady"] * steady,
        "bubble": bubble,
    }


def optimizer_seconds(counts: ModelCounts, cluster: Cluster, layout: Layout, dp: int, prec: Precision,
                      a: Assumptions, mem: dict[str, float]) -> dict[str, float]:
    """ZeRO-1/FSDP: reduce-scatter the gradients, update the local shard, all-gather the parameters."""
    per_rank_params = mem["weights"] / DTYPE_BYTES[prec.weights]
    ex_dp = max(dp // max(layout.ep, 1), 1)
    share_ex = counts.expert_params / counts.total_params
    ring = (1 - share_ex) * (dp - 1) / dp + share_ex * (ex_dp - 1) / ex_dp
    if layout.dp_shard == "fsdp":
        per_rank_params *= dp * (1 - share_ex) + ex_dp * share_ex
    nic = cluster.nic_bytes_s(a)
    reduce = per_rank_params * ring * a.grad_reduce_bytes / nic
    gather = per_rank_params * ring * DTYPE_BYTES[prec.weights] / nic if layout.dp_shard == "zero1" else 0.0
    state = DTYPE_BYTES[prec.master] + 2 * DTYPE_BYTES[prec.moments]
    update_bytes = 2 * mem["optimizer"] + per_rank_params * (DTYPE_BYTES[prec.grads] + DTYPE_BYTES[prec.weights]) \
        * (state > 0)
    update = update_bytes / (cluster.hardware.memory_bandwidth_gbs * GB * a.optimizer_hbm_efficiency)
    return {"grad_reduce_scatter": reduce, "param_all_gather": gather, "update": update,
            "total": reduce + gather + update}


# ---- the plan ---------------------------------------------------------------------------------------

@dataclass
class TrainPlan:
    layout: Layout
    dp: int
    micro_batches: int
    memory: dict[str, float]
    fits: bool
    breakdown: dict[str, float]
    optimizer: dict[str, float]
    step_s: float
    tokens_per_step: float
    tokens_per_day: float
    mfu_causal: float
    chunk: dict[str, float]
    ep_traffic: dict[str, Any] = field(default_factory=dict)
    train_args: list[str] | None = None  # the `dsv3 train` flags of this layout (None: the trainer cannot run it)
    train_args_note: str | None = None  # what the flags run instead of the plan, or why there are none

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = {**{k: getattr(self.layout, k) for k in PLANNED_FIELDS}, "label": label(self.layout)}
        out["memory_gb"] = {k: v / GB for k, v in self.memory.items()}
        del out["memory"]
        return out


MAX_GPUS = 2**20
PLANNED_FIELDS = ("pp", "ep", "dp_shard", "schedule", "tp", "dp")  # the Layout fields a plan reasons about


def trainer_flags(layout: Layout, micro_batches: int, domain: int,
                  layers: int) -> tuple[list[str] | None, str | None]:
    """The ``dsv3 train`` flags (`Layout.train_args`) that run a planned layout, and a note when they run
    something else or there are none. The plan's micro-batches per pipeline are ``--microbatches``; its EP
    groups span nodes of ``domain`` GPUs (``--gpus-per-node``; a group inside one node is one node); with one
    data-parallel replica its sharding is none (the same step). The
    trainer does not run the bidirectional DualPipe: its flags run DualPipeV on the same layout instead,
    when the model's ``layers`` fill DualPipeV's 2 x PP stages."""
    if layout.tp > 1:
        return None, (f"tensor parallelism (TP{layout.tp}) is modelled by the planner only; `dsv3 train` runs "
                      "pipeline, expert and data parallelism")
    run = replace(layout, gpus_per_node=min(layout.ep, domain) if layout.ep > 1 else 1,
                  microbatches=micro_batches if layout.pp > 1 else None,
                  dp_shard=layout.dp_shard if layout.dp > 1 else "none")  # one replica: nothing to shard
    note = None
    if layout.schedule == "dualpipe":
        run = replace(run, schedule="dualpipev")
        if model_stages(run) > layers:
            return None, (f"dsv3 train does not run the bidirectional DualPipe, and DualPipeV on PP{layout.pp} "
                          f"would cut the {layers} layers into {model_stages(run)} stages")
        note = ("dsv3 train does not run the bidirectional DualPipe (two copies of the model); these flags run "
                "DualPipeV, its one-copy V, on the same layout (plan it with --schedule dualpipev)")
    try:
        return run.check(layout.world).train_args(), note
    except DSV3Error as err:
        return None, f"dsv3 train cannot run this layout: {err}"


def check_cluster(cluster: Cluster) -> None:
    """GPU count, network name and link rates that the model can use, or one clear error."""
    from dsv3.network.catalog import KINDS

    cluster.knobs.check()
    if not 1 <= cluster.gpus <= MAX_GPUS:
        raise DSV3Error(f"--gpus must be between 1 and {MAX_GPUS:,}, got {cluster.gpus}")
    if cluster.network not in KINDS:
        raise DSV3Error(f"unknown topology {cluster.network!r}; choose one of {', '.join(KINDS)}")
    a = Assumptions()
    if cluster.gpus > cluster.domain and cluster.nic_bytes_s(a) <= 0:
        raise DSV3Error(f"{cluster.hardware.name} has no scale-out bandwidth; give --nic-gbps")
    if cluster.gpus > 1 and cluster.nvlink_bytes_s(a) <= 0:
        raise DSV3Error(f"{cluster.hardware.name} has no link to other GPUs; give --nvlink-GBps or --nic-gbps")


def check_layout(layout: Layout, gpus: int, global_batch: int, arch: Architecture, a: Assumptions) -> int:
    """The data-parallel degree of a layout, or one clear error naming what does not divide."""
    if layout.schedule not in MODELLED_SCHEDULES:
        others = [s for s in PLANNED_SCHEDULES if s not in MODELLED_SCHEDULES]
        raise DSV3Error(f"--pp-schedule must be one of {', '.join(MODELLED_SCHEDULES)}, got {layout.schedule!r} "
                        f"(dsv3 train also runs {' and '.join(others)}; the planner does not price them)")
    if layout.dp_shard not in SHARDINGS:
        raise DSV3Error(f"--dp-shard must be one of {', '.join(SHARDINGS)}, got {layout.dp_shard!r}")
    if min(layout.pp, layout.ep, layout.tp) < 1:
        raise DSV3Error("--pp, --ep and --tp must be >= 1")
    if gpus % (layout.pp * layout.tp) or layout.world != gpus:
        raise DSV3Error(f"layout PP{layout.pp} x TP{layout.tp} x DP{layout.dp} does not match {gpus} GPUs "
                        f"(PP x TP x DP must equal --gpus)")
    dp = layout.dp
    if dp % layout.ep:
        raise DSV3Error(f"EP{layout.ep} must divide the data-parallel degree {dp} (= {gpus} GPUs / PP{layout.pp}"
                        f"{f' / TP{layout.tp}' if layout.tp > 1 else ''}): EP borrows the data-parallel ranks")
    if layout.ep > 1 and (not arch.is_moe or arch.moe.n_routed % layout.ep):
        raise DSV3Error(f"EP{layout.ep} must divide the {arch.moe.n_routed if arch.is_moe else 0} routed experts")
    if layout.schedule in ("dualpipe", "dualpipev") and layout.pp % 2:
        raise DSV3Error(f"{layout.schedule} needs an even --pp, got {layout.pp}")
    stages = model_stages(layout)
    if stages > arch.num_layers + arch.mtp_layers:
        raise DSV3Error(f"{stages} pipeline stages exceed the {arch.num_layers + arch.mtp_layers} layers "
                        f"of {arch.name}")
    if global_batch % (dp * a.micro_batch_seqs):
        raise DSV3Error(f"--global-batch {global_batch} sequences is not a multiple of DP {dp} x micro-batch "
                        f"{a.micro_batch_seqs}")
    return dp


def plan_train(arch: Architecture, cluster: Cluster, layout: Layout, seq_len: int, global_batch: int,
               prec: Precision = Precision(), a: Assumptions = Assumptions()) -> TrainPlan:
    """Memory per GPU and step time of one layout."""
    a.check()
    prec.check()
    check_cluster(cluster)
    if seq_len < 1 or global_batch < 1:
        raise DSV3Error("--seq-len and --global-batch must be >= 1")
    dp = check_layout(layout, cluster.gpus, global_batch, arch, a)
    counts = model_counts(arch)
    chunks = global_batch // (dp * a.micro_batch_seqs)
    if layout.schedule in ("dualpipe", "dualpipev") and chunks < 2 * layout.pp:
        raise DSV3Error(f"{layout.schedule} needs at least 2 x PP = {2 * layout.pp} micro-batches per pipeline; "
                        f"the global batch gives {chunks}")
    if layout.schedule == "1f1b" and chunks < layout.pp:
        raise DSV3Error(f"1f1b needs at least PP = {layout.pp} micro-batches per pipeline; got {chunks}")
    mem = memory_per_gpu(arch, counts, layout, dp, seq_len, prec, a)
    ct = chunk_times(arch, counts, cluster, layout, seq_len, prec, a)
    parts = step_breakdown(ct, layout, chunks, a)
    opt = optimizer_seconds(counts, cluster, layout, dp, prec, a, mem)
    parts["opt"] = opt["total"]
    step = sum(parts.values())
    tokens = global_batch * seq_len
    flags, note = trainer_flags(layout, chunks, cluster.domain, counts.layers)
    causal_flops = tokens * train_flops_per_token(arch, count_params(arch), seq_len)  # Table 4's MFU: no MTP
    return TrainPlan(
        layout=layout, dp=dp, micro_batches=chunks, memory=mem, fits=mem["total"] <= capacity_bytes(cluster.hardware),
        breakdown=parts, optimizer=opt, step_s=step, tokens_per_step=tokens, tokens_per_day=tokens / step * 86400,
        mfu_causal=causal_flops / step / cluster.gpus / (cluster.hardware.bf16_tflops * 1e12),
        chunk=asdict(ct), ep_traffic=_traffic_summary(arch, cluster, layout, a),
        train_args=flags, train_args_note=note,
    )


def _traffic_summary(arch: Architecture, cluster: Cluster, layout: Layout, a: Assumptions) -> dict[str, Any]:
    """What the all-to-all prices rest on: copies per token and the simulated fabric factor."""
    if not arch.is_moe or layout.ep <= 1:
        return {}
    t = ep_traffic(arch.moe.n_routed, arch.moe.top_k, layout.ep, cluster.domain, _node_limit(a, layout, cluster))
    disp, comb = token_bytes(arch, cluster.knobs)
    return {**asdict(t), "fabric_factor": _fabric(cluster, layout.ep), "dispatch_bytes_per_copy": disp,
            "combine_bytes_per_copy": comb}


def capacity_bytes(hw: Hardware) -> float:
    """HBM sizes are binary: an "80 GB" H800 holds 80 GiB (nvidia-smi shows 81,559 MiB usable)."""
    return hw.memory_gb * 2**30


def gpu_hours(plan: TrainPlan, gpus: int, tokens: float = V3_PRETRAIN_TOKENS) -> float:
    return tokens / plan.tokens_per_day * 24 * gpus


# ---- search -----------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    """Divisors in increasing order, in O(sqrt n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidate_layouts(arch: Architecture, gpus: int, global_batch: int, a: Assumptions,
                      dp_shards: tuple[str, ...] = ("zero1", "fsdp"),
                      schedules: tuple[str, ...] = MODELLED_SCHEDULES,
                      tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[Layout]:
    """Every layout the checks accept: PP x TP x DP = GPUs, EP dividing DP and the expert count."""
    out = []
    for tp in tps:
        for pp in _divisors(gpus // tp) if gpus % tp == 0 else []:
            if pp > arch.num_layers:
                continue
            dp = gpus // (pp * tp)
            eps = [e for e in _divisors(dp) if not arch.is_moe or arch.moe.n_routed % e == 0] if arch.is_moe else [1]
            for ep in eps:
                for schedule in schedules if pp > 1 else ("1f1b",):
                    for shard in dp_shards:
                        layout = planned_layout(gpus, pp, ep, shard, schedule, tp)
                        try:
                            check_layout(layout, gpus, global_batch, arch, a)
                        except DSV3Error:
                            continue
                        out.append(layout)
    return out


def search(arch: Architecture, cluster: Cluster, seq_len: int, global_batch: int, prec: Precision = Precision(),
           a: Assumptions = Assumptions(), top: int = 10, **space: Any) -> dict[str, Any]:
    """Rank the layouts that fit by tokens/day; say how many did not fit and the smallest memory need.

    `space` narrows the candidates (dp_shards, schedules, tps), as `candidate_layouts` takes them.
    """
    plans, refused = [], 0
    for layout in candidate_layouts(arch, cluster.gpus, global_batch, a, **space):
        try:
            plans.append(plan_train(arch, cluster, layout, seq_len, global_batch, prec, a))
        except DSV3Error:
            refused += 1
    fitting = sorted((p for p in plans if p.fits), key=lambda p: -p.tokens_per_day)
    if not fitting:
        least = min(plans, key=lambda p: p.memory["total"], default=None)
        need = f"; the smallest layout needs {least.memory['total'] / GB:.1f} GB per GPU ({label(least.layout)})" \
            if least else ""
        counts = model_counts(arch)
        per_param = DTYPE_BYTES[prec.weights] + DTYPE_BYTES[prec.grads] + DTYPE_BYTES[prec.master] \
            + 2 * DTYPE_BYTES[prec.moments]
        floor = counts.total_params * per_param / cluster.gpus / GB
        raise DSV3Error(f"no layout of {arch.name} fits in {cluster.hardware.memory_gb:g} GB on {cluster.gpus} GPUs"
                        f"{need}; its {counts.total_params / 1e9:.0f}B parameters x {per_param:g} B of weights, "
                        f"gradients and optimizer state alone need {floor:.0f} GB per GPU fully sharded")
    best_tp = max((p for p in fitting if p.layout.tp > 1), key=lambda p: p.tokens_per_day, default=None)
    trainer = next((p for p in fitting if p.train_args is not None and p.train_args_note is None), None)
    return {"ranked": fitting[:top], "considered": len(plans) + refused, "fit": len(fitting),
            "did_not_fit": len(plans) - len(fitting), "best_with_tp": best_tp, "best_for_trainer": trainer}


# ---- calibration ------------------------------------------------------------------------------------

def paper_setup() -> tuple[Architecture, Cluster, Layout, int, int]:
    """V3 on 2,048 H800s over MPFT: PP16 DualPipe, EP64, ZeRO-1, 15,360 x 4,096 tokens per step."""
    from dsv3.analysis.arch import load_architecture
    from dsv3.analysis.hardware import HARDWARE_PRESETS

    return (load_architecture("deepseek-v3"), Cluster(HARDWARE_PRESETS["h800"], 2048, "mpft"),
            planned_layout(2048, pp=16, ep=64, dp_shard="zero1", schedule="dualpipe"), 4096, 15360)


def is_paper_setup(arch: Architecture, cluster: Cluster, layout: Layout, seq_len: int, global_batch: int) -> bool:
    """Whether a plan is the one Table 4 measured (so its numbers can be printed beside the paper's)."""
    p_arch, p_cluster, p_layout, p_seq, p_batch = paper_setup()
    return (arch.name == p_arch.name and cluster == p_cluster and layout == p_layout and seq_len == p_seq
            and global_batch == p_batch)


def table4_errors(plan: TrainPlan) -> dict[str, float]:
    """Relative error of each Table 4 quantity the planner predicts."""
    b = plan.breakdown
    ours = {"step_s": plan.step_s, "1F_s": b["1F"], "1B_s": b["1B"], "1W_s": b["1W"], "1F1B_s": b["1F1B"],
            "bubble_s": b["bubble"], "opt_s": b["opt"], "tokens_per_day": plan.tokens_per_day}
    return {k: ours[k] / TABLE4[k] - 1 for k in ours}


def _fit_loss(a: Assumptions) -> float:
    arch, cluster, layout, seq, batch = paper_setup()
    err = table4_errors(plan_train(arch, cluster, layout, seq, batch, Precision(), a))
    return sum(math.log1p(err[k]) ** 2 for k in ("step_s", "1F_s", "1B_s", "1W_s", "1F1B_s"))


def fit_to_table4(points: int = 9, rounds: int = 4) -> dict[str, float]:
    """Refit the FITTED assumptions: least squares of log errors over step, 1F, 1B, 1W and 1F1B.

    A grid that shrinks around its best point each round; the answer is stable to about 0.005.
    """
    lo = np.array([0.05, 0.05, 0.0])
    hi = np.array([1.0, 1.0, 1.0])
    best = (math.inf, Assumptions())
    for _ in range(rounds):
        axes = [np.linspace(lo[i], hi[i], points) for i in range(3)]
        for g in axes[0]:
            for t in axes[1]:
                for o in axes[2]:
                    a = replace(Assumptions(), gemm_efficiency=float(g), attention_efficiency=float(t),
                                forward_alone_overlap=float(o))
                    best = min(best, (_fit_loss(a), a), key=lambda x: x[0])
        centre = np.array([getattr(best[1], n) for n in Assumptions.FITTED])
        half = (hi - lo) / (points - 1)
        lo, hi = np.maximum(centre - half, [0.01, 0.01, 0.0]), np.minimum(centre + half, 1.0)
    return {**{n: getattr(best[1], n) for n in Assumptions.FITTED}, "loss": best[0]}


def sensitivity(arch: Architecture, cluster: Cluster, layout: Layout, seq_len: int, global_batch: int,
                prec: Precision, a: Assumptions, delta: float = 0.1) -> list[dict[str, Any]]:
    """Elasticity of tokens/day to each input: % change of the answer per % change of the input (+10%)."""
    base = plan_train(arch, cluster, layout, seq_len, global_batch, prec, a).tokens_per_day
    hw = cluster.hardware
    nic = cluster.knobs.nic_gbps or hw.scale_out_gbs * 8
    nvl = cluster.knobs.nvlink_gbs or hw.scale_up_gbs
    cases = {
        "gemm efficiency (fitted)": (cluster, replace(a, gemm_efficiency=min(1.0, a.gemm_efficiency * (1 + delta)))),
        "attention efficiency (fitted)": (cluster, replace(a, attention_efficiency=min(
            1.0, a.attention_efficiency * (1 + delta)))),
        "NIC bandwidth": (replace(cluster, knobs=replace(cluster.knobs, nic_gbps=nic * (1 + delta))), a),
        "NVLink bandwidth": (replace(cluster, knobs=replace(cluster.knobs, nvlink_gbs=nvl * (1 + delta))), a),
        "forward-alone overlap (fitted)": (cluster, replace(a, forward_alone_overlap=min(
            1.0, a.forward_alone_overlap * (1 + delta)))),
        "pair overlap": (cluster, replace(a, pair_overlap=a.pair_overlap / 2)),
        "SMs for communication": (cluster, replace(a, comm_sms=round(a.comm_sms * (1 + delta)))),
        "HBM bandwidth": (replace(cluster, hardware=replace(hw, memory_bandwidth_gbs=hw.memory_bandwidth_gbs
                                                              * (1 + delta))), a),
    }
    rows = []
    for name, (cl, aa) in cases.items():
        value = plan_train(arch, cl, layout, seq_len, global_batch, prec, aa).tokens_per_day
        rows.append({"input": name, "change": "halved" if name == "pair overlap" else f"+{delta:.0%}",
                     "tokens_per_day_change": value / base - 1})
    return sorted(rows, key=lambda r: -abs(r["tokens_per_day_change"]))
