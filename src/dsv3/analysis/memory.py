"""KV cache and weight memory: the paper's Table 1 arithmetic, for any model, context and batch.

MLA caches one latent per token and layer, shared by all heads: (kv_lora_rank + qk_rope_head_dim)
elements. GQA caches K and V for each KV head: 2 x kv_heads x head_dim elements. Bytes are elements
times the element size; KB and GB are decimal (1000, 1e9), as the paper's 70.272 KB is.
"""

from __future__ import annotations

from dsv3.analysis.arch import Architecture
from dsv3.errors import DSV3Error

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "4bit": 0.5, "int4": 0.5, "fp4": 0.5,
}
WEIGHT_DTYPES = ("bf16", "fp8", "4bit")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a named dtype; 4-bit formats are 0.5 (block scales not counted)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise DSV3Error(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}") from None


def kv_elements_per_token(arch: Architecture) -> int:
    """Cached elements per token over all layers (V2 paper Table 1 formulas)."""
    a = arch.attention
    per_layer = a.kv_lora_rank + a.qk_rope_head_dim if a.kind == "mla" else 2 * a.num_kv_heads * a.qk_head_dim
    return per_layer * arch.num_layers


def kv_bytes_per_token(arch: Architecture, dtype: str = "bf16") -> float:
    return kv_elements_per_token(arch) * dtype_bytes(dtype)


def kv_cache_bytes(arch: Architecture, context: int, batch: int = 1, dtype: str = "bf16") -> float:
    """The whole cache for `batch` sequences of `context` tokens each."""
    if context < 0 or batch < 1:
        raise DSV3Error(f"context must be >= 0 and batch >= 1, got context={context}, batch={batch}")
    return kv_bytes_per_token(arch, dtype) * context * batch


def weight_bytes(num_params: int, dtype: str) -> float:
    """Weights stored in one dtype; FP8 block scales (4 B per 128x128 block, 0.02%) are not counted."""
    return num_params * dtype_bytes(dtype)
