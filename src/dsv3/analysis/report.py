"""`dsv3 analyze` as data: one dict (the --json object) holding a model's memory, FLOPs, bounds and costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv3.analysis import bounds, flops, memory
from dsv3.analysis.arch import Architecture
from dsv3.analysis.hardware import Hardware
from dsv3.analysis.params import CATEGORIES, ParamCounts, count_params
from dsv3.errors import DSV3Error

CONVENTIONS = {
    "params": "total_params and active_params both include the input embedding and the output head (a tied "
              "head counted once); MTP modules are excluded and reported as mtp_params; routed experts count "
              "top_k of n_routed in active_params.",
    "kv_cache": "MLA: (kv_lora_rank + qk_rope_head_dim) x layers x bytes; GQA/MQA/MHA: 2 x kv_heads x head_dim "
                "x layers x bytes; KB/MB/GB are decimal; main-model layers only.",
    "weights": "bytes = parameters x bits/8 (bf16 2, fp8 1, 4bit 0.5); quantization scales not counted.",
    "train_flops": "6 x activated matmul params (attention projections, activated experts, router, output head; "
                   "no embedding lookup, norms or MTP) + 3 x layers x heads x (d_qk + d_v) x seq_len for causal "
                   "attention (6 x for non-causal); reproduces ISCA Table 2's V2 and V3 rows.",
    "inference_flops": "prefill: 2N + layers x heads x (d_qk + d_v) x seq_len per prompt token (causal average); "
                       "decode: 2N + 2 x layers x heads x (d_qk + d_v) x context; MLA absorbed decode uses "
                       "(2 x kv_lora_rank + qk_rope_head_dim) per head per key instead.",
    "ep_bound": "ISCA §2.3.2: (dispatch + combine bytes) x tokens/device x (top_k + shared) x hidden / bandwidth "
                "per micro-batch, x micro-batches x layers per token; compute fully overlapped, no latency.",
    "local_decode": "batch 1: memory bandwidth / (activated weights minus the embedding table plus one row, "
                    "at weight_dtype, + KV cache of the context at kv_dtype); one device, no overlap losses.",
    "mtp": "speed-up = (1 + sum_{k<=depth} acceptance^k) / (1 + step overhead).",
}


@dataclass
class AnalyzeOptions:
    seq_len: int = 4096
    context: int | None = None  # decode context; defaults to seq_len
    batch: int = 1
    kv_dtype: str = "bf16"
    weight_dtype: str = "4bit"  # for the local-decode bound
    tokens_per_device: int = 32
    dispatch_bytes: float = 1.0
    combine_bytes: float = 2.0
    micro_batches: int = 2
    mtp_acceptance: float = 0.8
    train_tokens: float = 14.8e12
    mfu: float = 0.3894  # ISCA Table 4, causal MFU (MPFT)
    usd_per_gpu_hour: float | None = None  # defaults to the training hardware's price, else 2.0

    def check(self) -> None:
        if self.seq_len < 1 or self.batch < 1 or (self.context is not None and self.context < 0):
            raise DSV3Error("seq-len and batch must be >= 1 and context >= 0")
        if self.tokens_per_device < 1 or self.micro_batches < 1:
            raise DSV3Error("tokens-per-device and micro-batches must be >= 1")
        memory.dtype_bytes(self.kv_dtype)
        memory.dtype_bytes(self.weight_dtype)


def _model_summary(arch: Architecture) -> dict[str, Any]:
    a = arch.attention
    out = {
        "name": arch.name, "model_type": arch.model_type, "attention": a.kind, "layers": arch.num_layers,
        "hidden_size": arch.hidden_size, "heads": a.num_heads, "kv_heads": a.num_kv_heads,
        "qk_head_dim": a.qk_head_dim, "v_head_dim": a.v_head_dim, "vocab_size": arch.vocab_size,
        "moe_layers": len(arch.moe_layers), "mtp_layers": arch.mtp_layers,
    }
    if a.kind == "mla":
        out.update(kv_lora_rank=a.kv_lora_rank, qk_rope_head_dim=a.qk_rope_head_dim, q_lora_rank=a.q_lora_rank)
    if arch.moe is not None:
        out.update(routed_experts=arch.moe.n_routed, experts_per_token=arch.moe.top_k,
                   shared_experts=arch.moe.n_shared)
    return out


def _params_section(counts: ParamCounts) -> dict[str, Any]:
    return {
        "total_params": counts.total_params,
        "active_params": counts.active_params,
        "matmul_active_params": counts.matmul_active,
        "mtp_params": counts.mtp_total,
        "mtp_active_params": counts.mtp_active,
        "total_params_with_mtp": counts.total_params + counts.mtp_total,
        "params_by_category": {c: {"total": counts.total[c], "active": counts.active[c]} for c in CATEGORIES},
    }


def _memory_section(arch: Architecture, counts: ParamCounts, opts: AnalyzeOptions, context: int) -> dict:
    return {
        "kv_bytes_per_token": memory.kv_bytes_per_token(arch, "bf16"),
        "kv_dtype": opts.kv_dtype,
        "kv_bytes_per_token_at_kv_dtype": memory.kv_bytes_per_token(arch, opts.kv_dtype),
        "kv_cache": {"context": context, "batch": opts.batch,
                     "bytes": memory.kv_cache_bytes(arch, context, opts.batch, opts.kv_dtype)},
        "weight_bytes": {d: memory.weight_bytes(counts.total_params, d) for d in memory.WEIGHT_DTYPES},
        "weight_bytes_with_mtp": {d: memory.weight_bytes(counts.total_params + counts.mtp_total, d)
                                  for d in memory.WEIGHT_DTYPES},
    }


def _flops_section(arch: Architecture, counts: ParamCounts, seq_len: int, context: int) -> dict[str, Any]:
    return {
        "seq_len": seq_len,
        "train_flops_per_token": flops.train_flops_per_token(arch, counts, seq_len),
        "train_flops_per_token_noncausal": flops.train_flops_per_token(arch, counts, seq_len, causal=False),
        "train_flops_per_token_with_mtp": flops.train_flops_per_token(arch, counts, seq_len, include_mtp=True),
        "prefill_flops_per_token": flops.prefill_flops_per_token(arch, counts, seq_len),
        "decode_context": context,
        "decode_flops_per_token": flops.decode_flops_per_token(arch, counts, context),
        "decode_flops_per_token_absorbed": flops.decode_flops_per_token_absorbed(arch, counts, context),
    }


def _ep(arch: Architecture, bandwidth: float, opts: AnalyzeOptions) -> dict[str, float] | None:
    if not arch.is_moe or bandwidth <= 0:
        return None
    return bounds.ep_decode_bound_for(arch, bandwidth, opts.tokens_per_device, opts.dispatch_bytes,
                                      opts.combine_bytes, opts.micro_batches).as_dict()


def _hardware_rows(arch: Architecture, counts: ParamCounts, hardware: list[Hardware], opts: AnalyzeOptions,
                   context: int) -> list[dict[str, Any]]:
    rows = []
    for hw in hardware:
        local = bounds.local_decode(arch, counts, hw, opts.weight_dtype, opts.kv_dtype, context)
        rows.append({
            **local.as_dict(),
            "memory_gb": hw.memory_gb, "memory_bandwidth_gbs": hw.memory_bandwidth_gbs,
            "scale_up_gbs": hw.scale_up_gbs, "scale_up_domain": hw.scale_up_domain,
            "scale_out_gbs": hw.scale_out_gbs,
            "ep_bound_scale_out": _ep(arch, hw.scale_out_gbs, opts),
            "ep_bound_scale_up": _ep(arch, hw.scale_up_gbs, opts) if hw.scale_up_domain > 1 else None,
            "source": hw.source,
        })
    return rows


def analyze(arch: Architecture, hardware: list[Hardware], train_hw: Hardware,
            opts: AnalyzeOptions | None = None) -> dict[str, Any]:
    """Everything `dsv3 analyze` reports, as one JSON-ready dict."""
    opts = opts or AnalyzeOptions()
    opts.check()
    counts = count_params(arch)
    context = opts.seq_len if opts.context is None else opts.context
    train_flops = flops.train_flops_per_token(arch, counts, opts.seq_len)
    price = opts.usd_per_gpu_hour if opts.usd_per_gpu_hour is not None else (train_hw.usd_per_hour or 2.0)
    cost = bounds.training_cost(opts.train_tokens, train_flops, train_hw.bf16_tflops, opts.mfu, price)
    mtp_depth = max(arch.mtp_layers, 1)
    return {
        "model": _model_summary(arch),
        "conventions": CONVENTIONS,
        **_params_section(counts),
        **_memory_section(arch, counts, opts, context),
        **_flops_section(arch, counts, opts.seq_len, context),
        "ep_bound": _ep(arch, 50.0, opts),
        "ep_bound_assumptions": {"bandwidth_gbs": 50.0, "tokens_per_device": opts.tokens_per_device,
                                 "dispatch_bytes": opts.dispatch_bytes, "combine_bytes": opts.combine_bytes,
                                 "micro_batches": opts.micro_batches},
        "mtp": {"acceptance": opts.mtp_acceptance, "depth": mtp_depth, "has_mtp": arch.mtp_layers > 0,
                "speedup": bounds.mtp_speedup(opts.mtp_acceptance, mtp_depth)},
        "weight_dtype": opts.weight_dtype,
        "hardware": _hardware_rows(arch, counts, hardware, opts, context),
        "training_cost": {"hardware": train_hw.name, "usd_per_gpu_hour": price, **cost.as_dict()},
    }
