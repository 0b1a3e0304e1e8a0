"""`dsv3 plan serve`: prefill and decode throughput per node of a disaggregated EP deployment.

The same counts and the same rates as `plan train`, with the efficiencies fitted to Table 4 held fixed:
GEMMs at the fitted GEMM efficiency, the attention core at the fitted attention efficiency, weight and
KV-cache reads at the stated HBM efficiency, and the expert-parallel all-to-all from the same traffic
model. Two micro-batches overlap one's communication with the other's compute, as DeepSeek's serving
does; the result is bounded below by the EP communication bound of the ISCA paper (§2.3.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv3.analysis.arch import Architecture
from dsv3.analysis.memory import kv_bytes_per_token
from dsv3.analysis.params import attention_params, count_params, swiglu_params
from dsv3.analysis.plan import (
    GB,
    Assumptions,
    Cluster,
    Layout,
    _pair_seconds,
    capacity_bytes,
    check_cluster,
    token_bytes,
)
from dsv3.errors import DSV3Error

# DeepSeek's open-infra-index day-6 overview (Feb 2025): per H800 node, prefill and decode
PUBLISHED = {"prefill_tokens_per_s_per_node": 73.7e3, "decode_tokens_per_s_per_node": 14.8e3}
GPUS_PER_NODE = 8  # "per node" means per 8 GPUs (an HGX H800 node), whatever the scale-up domain


@dataclass(frozen=True)
class ServeOptions:
    context: int = 4989  # average KV length DeepSeek reported
    decode_batch: int = 128  # sequences per decode GPU per step (two micro-batches of half)
    prefill_tokens: int = 16384  # prompt tokens per prefill GPU per step
    redundant_experts: int = 32
    mtp_acceptance: float = 0.85  # second-token acceptance, 80-90% in the papers
    hbm_efficiency: float = 0.7  # achieved / peak HBM bandwidth for streaming weights and KV cache
    cache_hit: float = 0.0  # share of prompt tokens served from a prefix cache (no compute)

    def check(self) -> None:
        if self.context < 1 or self.decode_batch < 2 or self.prefill_tokens < 2:
            raise DSV3Error("--context must be >= 1, --batch-per-gpu and --prefill-tokens >= 2")
        if not 0 <= self.mtp_acceptance < 1 or not 0 <= self.cache_hit < 1:
            raise DSV3Error("--mtp-acceptance and --cache-hit must be in [0, 1)")
        if not 0 < self.hbm_efficiency <= 1 or self.redundant_experts < 0:
            raise DSV3Error("--hbm-efficiency must be in (0, 1] and --redundant-experts >= 0")


def _rates(cluster: Cluster, a: Assumptions) -> tuple[float, float, float]:
    """(FP8 GEMM, BF16 attention, HBM) rates per GPU in FLOP/s and B/s, the comm SMs taken out."""
    hw, share = cluster.hardware, cluster.compute_share(a)
    return (hw.peak_tflops("fp8") * 1e12 * a.gemm_efficiency * share,
            hw.bf16_tflops * 1e12 * a.attention_efficiency * share, hw.memory_bandwidth_gbs * GB)


def _decode_nic_seconds(tokens: float, arch: Architecture, cluster: Cluster, ep: int, a: Assumptions) -> float:
    """Low-latency decode all-to-all: every routed copy goes straight to its GPU over RDMA (no NVLink hop);
    the shared expert is local. Multicast / in-network reduction cut one side to one copy per token."""
    nodes = max(ep // cluster.domain, 1)
    if nodes == 1:
        copies_nvl = arch.moe.top_k * (ep - 1) / ep
        disp, comb = token_bytes(arch, cluster.knobs)
        return tokens * copies_nvl * (disp + comb) / cluster.nvlink_bytes_s(a)
    k = cluster.knobs
    copies = arch.moe.top_k * (nodes - 1) / nodes
    disp, comb = token_bytes(arch, k)
    tx = tokens * ((1.0 if k.multicast else copies) * disp + copies * comb)
    rx = tokens * (copies * disp + (1.0 if k.in_network_reduce else copies) * comb)
    return max(tx, rx) / cluster.nic_bytes_s(a)


def decode(arch: Architecture, cluster: Cluster, gpus: int, opts: ServeOptions, a: Assumptions) -> dict[str, Any]:
    """One decode step of `decode_batch` sequences per GPU, EP over all decode GPUs, two micro-batches."""
    if not arch.is_moe:
        raise DSV3Error(f"{arch.name} has no routed experts; plan serve models expert-parallel MoE serving")
    if (arch.moe.n_routed + opts.redundant_experts) % gpus and gpus % (arch.moe.n_routed + opts.redundant_experts):
        raise DSV3Error(f"{arch.moe.n_routed} + {opts.redundant_experts} redundant experts do not spread evenly "
                        f"over {gpus} decode GPUs")
    gemm, attn_rate, hbm = _rates(cluster, a)
    hbm *= opts.hbm_efficiency
    b, L, d = opts.decode_batch, opts.context, arch.hidden_size
    at = arch.attention
    experts_per_gpu = max((arch.moe.n_routed + opts.redundant_experts) / gpus, 1.0) + arch.moe.n_shared
    expert = swiglu_params(arch, arch.moe.expert_intermediate).matmul
    per_layer_kv = kv_bytes_per_token(arch, "bf16") / arch.num_layers
    attn_w = attention_params(arch).matmul
    # compute of both micro-batches: attention projections, absorbed attention over the cache, experts
    attn_flops = 2 * attn_w * b + 2 * b * at.num_heads * (2 * at.kv_lora_rank + at.qk_rope_head_dim) * L
    moe_flops = 2 * expert * b * (arch.moe.top_k + arch.moe.n_shared)
    attn_s = max((2 * attn_w + b * L * per_layer_kv) / hbm, 2 * attn_w * b / gemm
                 + (attn_flops - 2 * attn_w * b) / attn_rate)
    moe_s = max(2 * experts_per_gpu * expert / hbm, moe_flops / gemm)
    comm = _decode_nic_seconds(b, arch, cluster, gpus, a)
    moe_layer = _pair_seconds(attn_s + moe_s, comm, a.pair_overlap)
    dense_layer = attn_s + max(2 * swiglu_params(arch, arch.dense_intermediate).matmul / hbm,
                               2 * swiglu_params(arch, arch.dense_intermediate).matmul * b / gemm)
    head = max(arch.vocab_size * d / hbm, 2 * arch.vocab_size * d * b / gemm)
    n_moe = len(arch.moe_layers)
    step = n_moe * moe_layer + (arch.num_layers - n_moe) * dense_layer + head
    mtp = arch.mtp_layers > 0 and opts.mtp_acceptance > 0
    if mtp:
        step *= (arch.num_layers + arch.mtp_layers) / arch.num_layers  # the MTP module runs each step too
    tokens_per_step = b * (1 + (opts.mtp_acceptance if mtp else 0.0))
    bound = arch.num_layers * comm  # the EP bound: compute fully hidden, communication only
    kv = b * L * kv_bytes_per_token(arch, "bf16")
    return {
        "gpus": gpus, "ep": gpus, "nodes": gpus / cluster.domain, "batch_per_gpu": b, "context": L,
        "step_ms": step * 1e3, "tpot_ms": step / (tokens_per_step / b) * 1e3,
        "user_tokens_per_s": tokens_per_step / b / step,
        "tokens_per_s_per_gpu": tokens_per_step / step,
        "tokens_per_s_per_node": tokens_per_step / step * GPUS_PER_NODE,
        "ep_comm_bound_tpot_ms": bound * 1e3,
        "per_layer_us": {"attention": attn_s * 1e6, "experts": moe_s * 1e6, "all_to_all": comm * 1e6},
        "kv_cache_gb": kv / GB, "fits": kv + experts_per_gpu * expert * len(arch.moe_layers)
        + attn_w * arch.num_layers <= capacity_bytes(cluster.hardware),
        "mtp_tokens_per_step": tokens_per_step / b,
    }


def prefill(arch: Architecture, cluster: Cluster, gpus: int, opts: ServeOptions, a: Assumptions) -> dict[str, Any]:
    """Prefill of `prefill_tokens` prompt tokens per GPU (prompts of `context` tokens), EP over the unit."""
    from dsv3.analysis.flops import attention_macs_per_key
    from dsv3.analysis.plan import ep_phase_seconds

    if not arch.is_moe:
        raise DSV3Error(f"{arch.name} has no routed experts; plan serve models expert-parallel MoE serving")
    gemm, attn_rate, _ = _rates(cluster, a)
    counts = count_params(arch)
    T = opts.prefill_tokens * (1 - opts.cache_hit)
    mm = 2 * counts.matmul_active * T / gemm
    attn = attention_macs_per_key(arch) * opts.context * T / attn_rate  # causal average: half of 2 x macs x L
    comm = len(arch.moe_layers) * ep_phase_seconds(T, arch, cluster, Layout(pp=1, ep=gpus), a)
    step = _pair_seconds(mm + attn, comm, a.pair_overlap)
    per_gpu = opts.prefill_tokens / step
    return {
        "gpus": gpus, "ep": gpus, "nodes": gpus / cluster.domain, "tokens_per_gpu": opts.prefill_tokens,
        "context": opts.context, "cache_hit": opts.cache_hit, "step_ms": step * 1e3,
        "compute_ms": (mm + attn) * 1e3, "all_to_all_ms": comm * 1e3,
        "tokens_per_s_per_gpu": per_gpu, "tokens_per_s_per_node": per_gpu * GPUS_PER_NODE,
        "ttft_ms_for_context": opts.context / per_gpu * 1e3,
    }


def plan_serve(arch: Architecture, cluster: Cluster, prefill_gpus: int, decode_gpus: int, opts: ServeOptions,
               a: Assumptions = Assumptions()) -> dict[str, Any]:
    """Both phases, the published figures beside them, and the assumptions used."""
    a.check()
    opts.check()
    check_cluster(cluster)
    if prefill_gpus < 1 or decode_gpus < 1:
        raise DSV3Error("--prefill-gpus and --decode-gpus must be >= 1")
    pre, dec = prefill(arch, cluster, prefill_gpus, opts, a), decode(arch, cluster, decode_gpus, opts, a)
    out: dict[str, Any] = {"prefill": pre, "decode": dec}
    if arch.name == "deepseek-v3" and cluster.hardware.name == "h800":
        out["published"] = {
            **PUBLISHED,
            "prefill_ratio": pre["tokens_per_s_per_node"] / PUBLISHED["prefill_tokens_per_s_per_node"],
            "decode_ratio": dec["tokens_per_s_per_node"] / PUBLISHED["decode_tokens_per_s_per_node"],
        }
    return out
