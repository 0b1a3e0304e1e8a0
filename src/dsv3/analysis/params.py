"""Parameter counts by category, total and activated per token, from an Architecture.

Conventions (stated because papers differ):
- The input embedding and the output head are counted in BOTH the total and the activated count
  (DeepSeek's README_WEIGHTS convention: "36.7B activated, including 0.9B embedding and 0.9B head").
  A tied head is one tensor: it is counted once, under `embedding`.
- MTP modules are not part of the main model: `total_params` excludes them (DeepSeek-V3 = 671B) and
  they are reported separately (`mtp`), their shared embedding and head not counted again.
- `matmul_active` counts only weights that take part in a matrix multiply for one token: attention
  projections, the activated FFN experts, the router and the output head. It excludes the embedding
  lookup, norms and biases; it is the N of the "6 N" FLOP rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv3.analysis.arch import Architecture

CATEGORIES = ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts", "router", "norms",
              "output_head")


@dataclass(frozen=True)
class LayerParams:
    """One component's parameter count, split into all weights and those a token multiplies by."""

    total: int
    matmul: int


@dataclass
class ParamCounts:
    total: dict[str, int] = field(default_factory=dict)  # category -> parameters in the main model
    active: dict[str, int] = field(default_factory=dict)  # category -> parameters one token touches
    matmul_active: int = 0  # N of "6N": activated matmul weights (no embedding lookup, norms, biases)
    mtp_total: int = 0  # all MTP modules, shared embedding/head excluded
    mtp_active: int = 0
    mtp_matmul_active: int = 0  # includes one more pass through the shared output head per module

    @property
    def total_params(self) -> int:
        return sum(self.total.values())

    @property
    def active_params(self) -> int:
        return sum(self.active.values())


def attention_params(arch: Architecture) -> LayerParams:
    """One attention block: projections (+ MLA's internal latent norms, biases, Qwen3's q/k norms)."""
    a, d = arch.attention, arch.hidden_size
    if a.kind == "mla":
        nope = a.qk_head_dim - a.qk_rope_head_dim
        if a.q_lora_rank:
            q = d * a.q_lora_rank + a.q_lora_rank * a.num_heads * a.qk_head_dim
            q_norm = a.q_lora_rank
        else:
            q, q_norm = d * a.num_heads * a.qk_head_dim, 0
        kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.num_heads * (nope + a.v_head_dim)
        o = a.num_heads * a.v_head_dim * d
        matmul = q + kv + o
        bias = ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim + d) if a.qkv_bias else 0
        return LayerParams(total=matmul + q_norm + a.kv_lora_rank + bias, matmul=matmul)
    q_width, kv_width = a.num_heads * a.qk_head_dim, a.num_kv_heads * a.qk_head_dim
    matmul = d * q_width + 2 * d * kv_width + q_width * d
    bias = (q_width + 2 * kv_width if a.qkv_bias else 0) + (d if a.o_bias else 0)
    norms = 2 * a.qk_head_dim if a.qk_norm else 0
    return LayerParams(total=matmul + bias + norms, matmul=matmul)


def swiglu_params(arch: Architecture, width: int) -> LayerParams:
    """gate, up and down projections of one SwiGLU FFN of the given width."""
    matmul = 3 * arch.hidden_size * width
    bias = 2 * width + arch.hidden_size if arch.mlp_bias else 0
    return LayerParams(total=matmul + bias, matmul=matmul)


def router_params(arch: Architecture) -> LayerParams:
    moe = arch.moe
    assert moe is not None
    matmul = moe.n_routed * arch.hidden_size + (arch.hidden_size if moe.shared_expert_gate else 0)
    return LayerParams(total=matmul + (moe.n_routed if moe.router_bias else 0), matmul=matmul)


def _moe_ffn(arch: Architecture) -> dict[str, tuple[int, int, int]]:
    """One MoE layer's FFN: category -> (total, active, activated matmul)."""
    moe = arch.moe
    assert moe is not None
    expert = swiglu_params(arch, moe.expert_intermediate)
    shared = swiglu_params(arch, moe.shared_intermediate) if moe.shared_intermediate else LayerParams(0, 0)
    router = router_params(arch)
    return {
        "routed_experts": (moe.n_routed * expert.total, moe.top_k * expert.total, moe.top_k * expert.matmul),
        "shared_experts": (shared.total, shared.total, shared.matmul),
        "router": (router.total, router.total, router.matmul),
    }


def count_params(arch: Architecture) -> ParamCounts:
    """Total and activated parameters by category, plus the MTP modules apart."""
    d, v, n_layers = arch.hidden_size, arch.vocab_size, arch.num_layers
    attn = attention_params(arch)
    dense = swiglu_params(arch, arch.dense_intermediate)
    n_moe, n_dense = len(arch.moe_layers), arch.num_dense_layers
    counts = ParamCounts()
    rows: dict[str, tuple[int, int, int]] = {
        "embedding": (v * d, v * d, 0),
        "attention": (n_layers * attn.total, n_layers * attn.total, n_layers * attn.matmul),
        "dense_ffn": (n_dense * dense.total, n_dense * dense.total, n_dense * dense.matmul),
        "routed_experts": (0, 0, 0), "shared_experts": (0, 0, 0), "router": (0, 0, 0),
        "norms": ((2 * n_layers + 1) * d, (2 * n_layers + 1) * d, 0),
        "output_head": (0 if arch.tie_word_embeddings else v * d,) * 2 + (v * d,),
    }
    if arch.is_moe:
        for name, (total, active, matmul) in _moe_ffn(arch).items():
            rows[name] = (n_moe * total, n_moe * active, n_moe * matmul)
    for name in CATEGORIES:
        total, active, matmul = rows[name]
        counts.total[name], counts.active[name] = total, active
        counts.matmul_active += matmul
    _add_mtp(arch, counts, attn, dense)
    return counts


def _add_mtp(arch: Architecture, counts: ParamCounts, attn: LayerParams, dense: LayerParams) -> None:
    """Each MTP module: enorm, hnorm, eh_proj [D, 2D], one full block, shared_head.norm."""
    if not arch.mtp_layers:
        return
    d = arch.hidden_size
    own_norms = 3 * d + 2 * d  # enorm, hnorm, shared_head.norm + the block's two norms
    eh_proj = 2 * d * d
    if arch.mtp_is_moe and arch.moe is not None:
        ffn = _moe_ffn(arch)
        ffn_total = sum(t for t, _, _ in ffn.values())
        ffn_active = sum(a for _, a, _ in ffn.values())
        ffn_matmul = sum(m for _, _, m in ffn.values())
    else:
        ffn_total = ffn_active = dense.total
        ffn_matmul = dense.matmul
    per_module_total = own_norms + eh_proj + attn.total + ffn_total
    counts.mtp_total = arch.mtp_layers * per_module_total
    counts.mtp_active = arch.mtp_layers * (own_norms + eh_proj + attn.total + ffn_active)
    head = arch.vocab_size * d  # the shared head runs again on each module's output
    counts.mtp_matmul_active = arch.mtp_layers * (eh_proj + attn.matmul + ffn_matmul + head)
