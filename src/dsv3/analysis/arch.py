"""One architecture description for every model the analyzer reads: DeepSeek MLA + MoE and GQA/MQA/MHA.

`ModelConfig` covers DeepSeek V2/V3 only. The analyzer also has to price Llama, Qwen2, Qwen3(-MoE),
Mistral and Mixtral, so both are reduced here to the few numbers the arithmetic needs: widths, head
counts, which layers are MoE, and the small extras (biases, q/k norms) that change parameter counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv3.config import CONFIGS_DIR, LIMITS_BY_HF_NAME, PRESETS, ModelConfig, load_config
from dsv3.errors import DSV3Error
from dsv3.io import read_json_object

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_TYPES = (*DEEPSEEK_TYPES, *GQA_TYPES)


@dataclass(frozen=True)
class Attention:
    """Attention widths. For MLA, `num_kv_heads` is the head count after the latent up-projection."""

    kind: str  # "mla" | "gqa" | "mqa" | "mha"
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # MLA only; None = plain q_proj
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only (decoupled RoPE key, shared by all heads)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k


@dataclass(frozen=True)
class MoE:
    """Routed experts (each a SwiGLU of width `expert_intermediate`) plus optional shared experts."""

    n_routed: int
    top_k: int
    expert_intermediate: int
    n_shared: int = 0  # shared experts as the EP bound counts them (always-selected experts)
    shared_intermediate: int = 0  # total SwiGLU width of the shared experts
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (a D x 1 matmul)


@dataclass(frozen=True)
class Architecture:
    """The numbers that memory, FLOP and speed arithmetic need, for any supported HF config."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: Attention
    dense_intermediate: int  # SwiGLU width of the dense (non-MoE) layers
    moe: MoE | None
    moe_layers: tuple[int, ...]  # indices of the MoE layers
    tie_word_embeddings: bool = False
    mlp_bias: bool = False
    mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction modules (not in the main model)
    mtp_is_moe: bool = False  # whether the MTP block's FFN is MoE (V3: yes)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and bool(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)


# ---- DeepSeek ------------------------------------------------------------------------------

def from_model_config(cfg: ModelConfig, name: str = "") -> Architecture:
    """A DeepSeek V2/V3 `ModelConfig` as an Architecture (MLA attention, DeepSeekMoE)."""
    attn = Attention(
        kind="mla", num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_attention_heads,
        qk_head_dim=cfg.qk_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qkv_bias=bool(cfg.attention_bias),
    )
    moe = None
    if cfg.has_moe:
        n_shared = cfg.n_shared_experts or 0
        moe = MoE(
            n_routed=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
            expert_intermediate=cfg.moe_intermediate_size, n_shared=n_shared,
            shared_intermediate=n_shared * cfg.moe_intermediate_size,
            router_bias=cfg.topk_method == "noaux_tc",
        )
    moe_layers = tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    return Architecture(
        name=name or cfg.model_type, model_type=cfg.model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, attention=attn,
        dense_intermediate=cfg.intermediate_size, moe=moe, moe_layers=moe_layers,
        tie_word_embeddings=cfg.tie_word_embeddings,
        # DeepSeek-V2 has no MTP; ModelConfig's default of one module applies to V3-style configs only.
        mtp_layers=0 if cfg.model_type == "deepseek_v2" else cfg.num_nextn_predict_layers,
        mtp_is_moe=cfg.is_moe_layer(cfg.num_hidden_layers),
    )


# ---- GQA / MQA / MHA families ------------------------------------------------------------------

def _require_int(data: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise DSV3Error(f"{where}: config lacks {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise DSV3Error(f"{where}: {key} must be a positive integer, got {value!r}")
    if value > LIMITS_BY_HF_NAME.get(key, value):  # the bounds DeepSeek configs get (dsv3.config)
        raise DSV3Error(f"{where}: {key} = {value} exceeds dsv3's limit of {LIMITS_BY_HF_NAME[key]:,}")
    return value


def _attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "mha"
    return "mqa" if num_kv_heads == 1 else "gqa"


def _gqa_attention(data: dict[str, Any], model_type: str, where: str) -> Attention:
    hidden = _require_int(data, "hidden_size", where)
    heads = _require_int(data, "num_attention_heads", where)
    kv_heads = _require_int(data, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise DSV3Error(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                        f"num_key_value_heads ({kv_heads})")
    if data.get("head_dim") is None and hidden % heads:
        raise DSV3Error(f"{where}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                        "and no head_dim is given")
    head_dim = _require_int(data, "head_dim", where, default=hidden // heads)
    # Qwen2 and Qwen2-MoE always carry q/k/v biases; the others follow `attention_bias`.
    qkv_bias = True if model_type in ("qwen2", "qwen2_moe") else bool(data.get("attention_bias", False))
    o_bias = bool(data.get("attention_bias", False)) and model_type not in ("qwen2", "qwen2_moe")
    return Attention(
        kind=_attention_kind(heads, kv_heads), num_heads=heads, num_kv_heads=kv_heads,
        qk_head_dim=head_dim, v_head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
    )


def _gqa_moe(data: dict[str, Any], model_type: str, num_layers: int, where: str) -> tuple[MoE | None, tuple]:
    """MoE description and MoE layer indices for Mixtral and Qwen-MoE naming."""
    if model_type == "mixtral":
        n = _require_int(data, "num_local_experts", where)
        k = _require_int(data, "num_experts_per_tok", where)
        width = _require_int(data, "intermediate_size", where)
        moe, layers = MoE(n_routed=n, top_k=k, expert_intermediate=width), tuple(range(num_layers))
    else:  # qwen2_moe, qwen3_moe
        n = _require_int(data, "num_experts", where)
        k = _require_int(data, "num_experts_per_tok", where)
        width = _require_int(data, "moe_intermediate_size", where)
        shared = (data.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        moe = MoE(n_routed=n, top_k=k, expert_intermediate=width, n_shared=1 if shared else 0,
                  shared_intermediate=shared, shared_expert_gate=bool(shared))
        step = _require_int(data, "decoder_sparse_step", where, default=1)
        dense_only = set(data.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    if k > n:
        raise DSV3Error(f"{where}: num_experts_per_tok ({k}) exceeds the number of experts ({n})")
    return moe, layers


def from_hf_dict(data: dict[str, Any], name: str = "") -> Architecture:
    """Any supported HF config dict; the family is taken from `model_type`, or guessed from the keys."""
    if not isinstance(data, dict):
        raise DSV3Error("a model config must be a JSON object")
    model_type = data.get("model_type") or _guess_model_type(data)
    where = name or model_type
    if model_type in DEEPSEEK_TYPES:
        return from_model_config(ModelConfig.from_dict(data).validate(), name=name or model_type)
    if model_type not in GQA_TYPES:
        raise DSV3Error(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_TYPES)}")
    if data.get("hidden_act", "silu") != "silu":
        raise DSV3Error(f"{where}: hidden_act {data.get('hidden_act')!r} is not supported (SwiGLU with silu only)")
    num_layers = _require_int(data, "num_hidden_layers", where)
    attn = _gqa_attention(data, model_type, where)
    moe, moe_layers = None, ()
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        moe, moe_layers = _gqa_moe(data, model_type, num_layers, where)
    dense_width = 0 if model_type == "mixtral" else _require_int(data, "intermediate_size", where)
    return Architecture(
        name=where, model_type=model_type, vocab_size=_require_int(data, "vocab_size", where),
        hidden_size=_require_int(data, "hidden_size", where), num_layers=num_layers, attention=attn,
        dense_intermediate=dense_width, moe=moe, moe_layers=moe_layers,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        mlp_bias=bool(data.get("mlp_bias", False)),
    )


def _guess_model_type(data: dict[str, Any]) -> str:
    """HF configs normally name their family; old or hand-written ones are recognised by their keys."""
    if "kv_lora_rank" in data:
        return "deepseek_v3" if "n_group" in data and data.get("topk_method") == "noaux_tc" else "deepseek_v2"
    if "num_local_experts" in data:
        return "mixtral"
    if "num_experts" in data and "moe_intermediate_size" in data:
        return "qwen3_moe"
    if "num_attention_heads" in data and "hidden_size" in data:
        return "llama"
    raise DSV3Error("cannot tell the model family: the config has no model_type and none of the known keys")


# ---- loading -----------------------------------------------------------------------------------

def shipped_configs() -> dict[str, Path]:
    """Public config.json files shipped with dsv3 (DeepSeek and the paper's comparison models)."""
    return {p.stem: p for p in sorted(CONFIGS_DIR.glob("*.json"))}


def preset_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*PRESETS, *shipped_configs()]))


def load_architecture(source: str | os.PathLike) -> Architecture:
    """A preset name (DeepSeek presets or a shipped public config) or a config.json / checkpoint folder."""
    if isinstance(source, str) and source in PRESETS:
        return from_model_config(load_config(source), name=source)
    if isinstance(source, str) and source in shipped_configs():
        return from_hf_dict(read_json_object(shipped_configs()[source]), name=source)
    if isinstance(source, str) and not Path(source).exists() and os.sep not in source and "." not in source:
        raise DSV3Error(f"unknown preset {source!r}; choose one of {', '.join(preset_names())}")
    path = Path(source)
    return from_hf_dict(read_json_object(path), name=path.parent.name if path.name == "config.json" else path.stem)


