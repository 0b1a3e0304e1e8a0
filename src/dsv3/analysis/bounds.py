"""Speed bounds and costs: the EP decode bound, MTP speed-up, bandwidth-bound local decode, training cost.

Each is a small closed form from the paper (ISCA §2.2.2, §2.3.2, §2.3.3; V3 Table 1) written as a
function of its inputs, so a user can put in their own model and hardware.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dsv3.analysis.arch import Architecture
from dsv3.analysis.hardware import Hardware
from dsv3.analysis.memory import dtype_bytes, kv_bytes_per_token, weight_bytes
from dsv3.analysis.params import ParamCounts
from dsv3.errors import DSV3Error

GB = 1e9


@dataclass(frozen=True)
class EPBound:
    """ISCA §2.3.2: with compute fully overlapped, each layer waits for dispatch + combine of every
    micro-batch; latency is ignored, so this is an upper bound on decode speed."""

    comm_time_s: float  # one micro-batch's dispatch + combine
    layer_time_s: float
    tpot_s: float  # time per output token
    tps: float  # tokens per second per sequence = 1 / TPOT

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ep_decode_bound(bandwidth_gbs: float, tokens_per_device: int = 32, experts_per_token: int = 9,
                    hidden: int = 7000, dispatch_bytes: float = 1, combine_bytes: float = 2,
                    layers: int = 61, micro_batches: int = 2) -> EPBound:
    """comm = (dispatch + combine bytes) x tokens x experts x hidden / bandwidth; TPOT = layers x mb x comm.

    The defaults are the paper's: 32 tokens per device, 8 routed + 1 shared expert, hidden "7K" = 7000,
    FP8 dispatch, BF16 combine, 61 layers, two micro-batches.
    """
    if bandwidth_gbs <= 0:
        raise DSV3Error(f"interconnect bandwidth must be positive, got {bandwidth_gbs} GB/s")
    volume = (dispatch_bytes + combine_bytes) * tokens_per_device * experts_per_token * hidden
    comm = volume / (bandwidth_gbs * GB)
    layer = micro_batches * comm
    tpot = layers * layer
    return EPBound(comm_time_s=comm, layer_time_s=layer, tpot_s=tpot, tps=1.0 / tpot)


def ep_decode_bound_for(arch: Architecture, bandwidth_gbs: float, tokens_per_device: int = 32,
                        dispatch_bytes: float = 1, combine_bytes: float = 2, micro_batches: int = 2) -> EPBound:
    """The EP bound with the model's own hidden size, experts per token (routed + shared) and layers."""
    if not arch.is_moe:
        raise DSV3Error(f"{arch.name} has no routed experts; the expert-parallel bound does not apply")
    experts = arch.moe.top_k + arch.moe.n_shared
    return ep_decode_bound(bandwidth_gbs, tokens_per_device, experts, arch.hidden_size, dispatch_bytes,
                           combine_bytes, arch.num_layers, micro_batches)


def mtp_speedup(acceptance: float, depth: int = 1, step_overhead: float = 0.0) -> float:
    """Decode speed-up of MTP self-speculation.

    Model: each step verifies `depth` drafted tokens; the k-th is kept only if all before it were, with
    probability acceptance^k, so a step yields 1 + sum_k acceptance^k tokens. A step costs
    (1 + step_overhead) of a plain step (the MTP module and the wider verify batch). With depth 1 and no
    overhead, 80% acceptance gives 1.8x and 90% gives 1.9x; the paper's 1.8x at 85-90% implies 3-6%.
    """
    if not 0 <= acceptance <= 1:
        raise DSV3Error(f"acceptance rate must be in [0, 1], got {acceptance}")
    if depth < 0 or step_overhead < 0:
        raise DSV3Error("MTP depth and step overhead must be >= 0")
    return (1 + sum(acceptance**k for k in range(1, depth + 1))) / (1 + step_overhead)


@dataclass(frozen=True)
class LocalDecode:
    """Batch-1 decode on one machine, bound by memory bandwidth: every token reads its weights and cache."""

    hardware: str
    weight_dtype: str
    bytes_per_token: float  # activated weights (embedding: one row) + KV cache at the context
    tps: float  # memory bandwidth / bytes per token
    model_bytes: float  # all weights + the KV cache of one sequence
    fits: bool
    devices_needed: int  # devices whose memory together holds model_bytes

    def as_dict(self) -> dict[str, float | str | bool | int]:
        return asdict(self)


def local_decode(arch: Architecture, counts: ParamCounts, hw: Hardware, weight_dtype: str = "4bit",
                 kv_dtype: str = "bf16", context: int = 4096) -> LocalDecode:
    """tokens/s <= bandwidth / (activated weight bytes + KV cache bytes read per token)."""
    w = dtype_bytes(weight_dtype)
    embedding_table = counts.active["embedding"]
    read_params = counts.active_params - embedding_table + arch.hidden_size  # lookup reads one row
    kv = kv_bytes_per_token(arch, kv_dtype) * context
    per_token = read_params * w + kv
    model = weight_bytes(counts.total_params, weight_dtype) + kv
    capacity = hw.memory_gb * GB
    return LocalDecode(
        hardware=hw.name, weight_dtype=weight_dtype, bytes_per_token=per_token,
        tps=hw.memory_bandwidth_gbs * GB / per_token, model_bytes=model, fits=model <= capacity,
        devices_needed=max(1, math.ceil(model / capacity)),
    )


@dataclass(frozen=True)
class TrainingCost:
    tokens: float
    flops_per_token: float
    peak_tflops: float
    mfu: float
    gpu_hours: float
    usd: float | None
    days_on: dict[int, float]  # GPU count -> wall-clock days

    def as_dict(self) -> dict:
        return {**asdict(self), "days_on": {str(k): v for k, v in self.days_on.items()}}


def training_cost(tokens: float, flops_per_token: float, peak_tflops: float, mfu: float,
                  usd_per_gpu_hour: float | None = None, gpus: tuple[int, ...] = (2048,)) -> TrainingCost:
    """GPU-hours = tokens x FLOPs/token / (peak x MFU) / 3600; dollars at a rental price."""
    if not 0 < mfu <= 1:
        raise DSV3Error(f"MFU must be in (0, 1], got {mfu}")
    if tokens <= 0 or flops_per_token <= 0 or peak_tflops <= 0:
        raise DSV3Error("tokens, FLOPs per token and peak TFLOPS must be positive")
    gpu_hours = tokens * flops_per_token / (peak_tflops * 1e12 * mfu) / 3600
    usd = None if usd_per_gpu_hour is None else gpu_hours * usd_per_gpu_hour
    return TrainingCost(tokens, flops_per_token, peak_tflops, mfu, gpu_hours, usd,
                        {g: gpu_hours / g / 24 for g in gpus})


def implied_mfu(gpu_hours: float, tokens: float, flops_per_token: float, peak_tflops: float) -> float:
    """The MFU at which `tokens` of training take `gpu_hours` (the inverse of training_cost)."""
    return tokens * flops_per_token / (peak_tflops * 1e12 * gpu_hours * 3600)
