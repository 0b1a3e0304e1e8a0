"""FLOPs per token for training and inference.

Convention (it reproduces ISCA Table 2's DeepSeek-V2 and V3 rows; docs/references.md#flops-per-token):
    train  = 6 N + c L H (d_qk + d_v) S,  c = 3 causal (half the score matrix), 6 non-causal
where N is the activated matmul weights (attention projections, activated experts, router, output head;
no embedding lookup, norms or MTP), L layers, H query heads, S the sequence length. A multiply-add is
2 FLOPs; backward costs twice forward. MLA's attention term uses the unabsorbed training path.
"""

from __future__ import annotations

from dsv3.analysis.arch import Architecture
from dsv3.analysis.params import ParamCounts


def attention_macs_per_key(arch: Architecture, layers: int | None = None) -> int:
    """Multiply-adds one query spends per attended key over all layers: QK^T (d_qk) plus AV (d_v)."""
    a = arch.attention
    return (arch.num_layers if layers is None else layers) * a.num_heads * (a.qk_head_dim + a.v_head_dim)


def train_flops_per_token(arch: Architecture, counts: ParamCounts, seq_len: int, causal: bool = True,
                          include_mtp: bool = False) -> float:
    """Forward + backward FLOPs per training token at sequence length `seq_len`."""
    factor = 3 if causal else 6
    flops = 6 * counts.matmul_active + factor * attention_macs_per_key(arch) * seq_len
    if include_mtp and arch.mtp_layers:
        flops += 6 * counts.mtp_matmul_active
        flops += factor * attention_macs_per_key(arch, layers=arch.mtp_layers) * seq_len
    return float(flops)


def prefill_flops_per_token(arch: Architecture, counts: ParamCounts, seq_len: int) -> float:
    """Forward FLOPs per prompt token, averaged over a causal prompt of `seq_len` tokens."""
    return float(2 * counts.matmul_active + attention_macs_per_key(arch) * seq_len)


def decode_flops_per_token(arch: Architecture, counts: ParamCounts, context: int) -> float:
    """Forward FLOPs for one new token attending to `context` cached tokens (keys/values materialised)."""
    return float(2 * counts.matmul_active + 2 * attention_macs_per_key(arch) * context)


def decode_flops_per_token_absorbed(arch: Architecture, counts: ParamCounts, context: int) -> float | None:
    """MLA's absorbed decode: each head scores against the latent (d_c + d_rope) and sums latents (d_c).

    The up-projections move onto the query and output, so the weight FLOPs are unchanged, but the
    per-key work grows from d_qk + d_v to 2 d_c + d_rope: more FLOPs, far fewer bytes read.
    """
    a = arch.attention
    if a.kind != "mla":
        return None
    per_key = arch.num_layers * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    return float(2 * counts.matmul_active + 2 * per_key * context)
