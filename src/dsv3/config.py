"""`ModelConfig`: every field of a DeepSeek V2/V3 Hugging Face ``config.json``, validated, with presets.

One dataclass serves the model, training, inference and the analyzer. Field names are the HF names, so a
config.json maps onto it key for key. Two rope layouts are read: the old one DeepSeek ships
(``rope_theta`` + ``rope_scaling``) and the new one transformers 5 writes (``rope_parameters``).
A few training knobs that no HF config carries (balancing speed, balance-loss alpha, MTP loss weight)
live here too, with the V3 report's values as defaults, and are written as extra keys that HF ignores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error
from dsv3.io import atomic_write_text, read_json_object

TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
SCORING_FUNCS = ("sigmoid", "softmax")
CONFIGS_DIR = Path(__file__).parent / "configs"


@dataclass
class RopeScaling:
    """YaRN context extension (the only scaling DeepSeek uses): frequency ramp plus mscale."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    type: str = "yarn"


@dataclass
class ModelConfig:
    """A DeepSeek V2/V3 architecture, field for field as in HF ``config.json``."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int | None = 8
    n_group: int | None = 8
    topk_group: int | None = 4
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    quantization_config: dict[str, Any] | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    torch_dtype: str = "bfloat16"
    # Training knobs (not in HF configs; V3 report values).
    bias_update_speed: float = 0.001  # gamma of aux-loss-free balancing; 0 disables
    aux_loss_alpha: float = 1e-4  # alpha of the complementary sequence-wise balance loss
    mtp_loss_weight: float = 0.3  # lambda of the MTP loss
    model_type: str = "deepseek_v3"
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # unknown keys, kept for round trips

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = _rope_scaling_from_dict(self.rope_scaling)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: dense for the first ``first_k_dense_replace`` layers, then MoE every
        ``moe_layer_freq``-th layer."""
        return (
            self.has_moe
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % max(self.moe_layer_freq, 1) == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times YaRN's mscale^2 when the context is extended (DeepSeek's correction)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim and rs.factor > 1:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    # ---- validation ---------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every inconsistency, one message each; empty when the config is usable."""
        p: list[str] = []
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "intermediate_size"]
        p += [f"{name} must be a positive integer, got {getattr(self, name)!r}"
              for name in positive if not _positive_int(getattr(self, name))]
        if self.qk_nope_head_dim is None or self.qk_nope_head_dim < 0:
            p.append(f"qk_nope_head_dim must be >= 0, got {self.qk_nope_head_dim!r}")
        if self.q_lora_rank is not None and not _positive_int(self.q_lora_rank):
            p.append(f"q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")
        if _positive_int(self.qk_rope_head_dim) and self.qk_rope_head_dim % 2:
            p.append(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.topk_method not in TOPK_METHODS:
            p.append(f"unknown topk_method {self.topk_method!r}; expected one of {', '.join(TOPK_METHODS)}")
        if self.scoring_func not in SCORING_FUNCS:
            p.append(f"unknown scoring_func {self.scoring_func!r}; expected one of {', '.join(SCORING_FUNCS)}")
        if self.hidden_act != "silu":
            p.append(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.num_nextn_predict_layers < 0:
            p.append(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.has_moe:
            p += self._moe_problems()
        rs = self.rope_scaling
        if rs is not None:
            if rs.type != "yarn":
                p.append(f"rope scaling type {rs.type!r} is not supported; DeepSeek uses 'yarn'")
            if not rs.factor or rs.factor <= 0:
                p.append(f"rope scaling factor must be positive, got {rs.factor!r}")
        return p

    def _moe_problems(self) -> list[str]:
        p: list[str] = []
        n, k = self.n_routed_experts, self.num_experts_per_tok
        groups, keep = self.n_group or 1, self.topk_group or 1
        if not _positive_int(self.moe_intermediate_size):
            p.append(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size!r}")
        if not _positive_int(k):
            p.append(f"num_experts_per_tok must be a positive integer, got {k!r}")
            return p
        if k > n:
            p.append(f"num_experts_per_tok ({k}) exceeds n_routed_experts ({n})")
        if n % groups:
            p.append(f"n_routed_experts ({n}) is not divisible by n_group ({groups})")
        if keep > groups:
            p.append(f"topk_group ({keep}) > n_group ({groups})")
        elif self.topk_method != "greedy" and n % groups == 0 and keep * (n // groups) < k:
            p.append(f"the {keep} kept groups hold {keep * (n // groups)} experts, fewer than "
                     f"num_experts_per_tok ({k})")
        if self.topk_method == "noaux_tc" and groups > 1 and n // groups < 2:
            p.append("noaux_tc scores a group by its top-2 experts, so each group needs at least 2 experts")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            p.append("first_k_dense_replace must be >= 0 and moe_layer_freq >= 1")
        return p

    def validate(self) -> ModelConfig:
        problems = self.problems()
        if problems:
            raise DSV3Error("invalid model config:\n  - " + "\n  - ".join(problems))
        return self

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """From a HF config dict in either rope layout; unknown keys are kept in ``extra``."""
        data = dict(data)
        rope_parameters = data.pop("rope_parameters", None)
        if rope_parameters:
            rope_parameters = dict(rope_parameters)
            data.setdefault("rope_theta", rope_parameters.pop("rope_theta", 10000.0))
            rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            data["rope_scaling"] = None if rope_type == "default" else rope_parameters
        elif "rope_scaling" in data and data["rope_scaling"] is not None:
            rope_type = data["rope_scaling"].get("type", data["rope_scaling"].get("rope_type"))
            if rope_type == "default":
                data["rope_scaling"] = None
        mtp_layers = data.pop("num_mtp_layers", None)  # transformers 5's alias
        # A config that names no MTP layers (every V2 config) has none.
        data.setdefault("num_nextn_predict_layers", mtp_layers or 0)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = _rope_scaling_from_dict(data["rope_scaling"])
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as exc:
            raise DSV3Error(f"invalid model config: {exc}") from None

    def to_dict(self, rope_layout: str = "old") -> dict[str, Any]:
        """A HF config dict. ``rope_layout="old"`` writes DeepSeek's keys, ``"new"`` transformers 5's."""
        out: dict[str, Any] = {"architectures": [_architecture(self.model_type)]}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "rope_scaling"):
                continue
            out[f.name] = getattr(self, f.name)
        rope = dataclasses.asdict(self.rope_scaling) if self.rope_scaling is not None else None
        if rope_layout == "new":
            del out["rope_theta"]
            params = {"rope_type": "default", "rope_theta": self.rope_theta}
            if rope is not None:
                rope_type = rope.pop("type")
                params = {"rope_type": rope_type, "rope_theta": self.rope_theta, **rope}
            out["rope_parameters"] = params
        else:
            out["rope_scaling"] = rope
        out["rope_interleave"] = True
        for key, value in self.extra.items():
            out.setdefault(key, value)
        if out.get("quantization_config") is None:
            out.pop("quantization_config")
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        return cls.from_dict(read_json_object(path)).validate()

    def save_json(self, path: str | os.PathLike, rope_layout: str = "old") -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        atomic_write_text(path, json.dumps(self.to_dict(rope_layout), indent=2) + "\n")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1 (1 when not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_scaling_from_dict(d: dict[str, Any]) -> RopeScaling:
    d = dict(d)
    rope_type = d.pop("type", None) or d.pop("rope_type", "yarn")
    d.pop("rope_type", None)
    d.pop("rope_theta", None)
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in d.items() if k in known and v is not None}
    return RopeScaling(**kwargs, type=rope_type)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _architecture(model_type: str) -> str:
    return "DeepseekV2ForCausalLM" if model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"


# ---- presets -----------------------------------------------------------------------------

def _small_moe(**overrides: Any) -> ModelConfig:
    return ModelConfig(**overrides, rope_scaling=None, torch_dtype="float32").validate()


TRAINABLE_PRESETS: dict[str, dict[str, Any]] = {
    # Learns visibly in a few minutes on 2 CPU cores: 4 layers (1 dense), 16 experts in 4 groups.
    "nano": dict(
        vocab_size=4096, hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        num_nextn_predict_layers=1, max_position_embeddings=1024, routed_scaling_factor=1.0,
    ),
    # About 100M parameters with MTP (about 40M activated); a GPU-sized but CPU-trainable V3.
    "small": dict(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=6, num_attention_heads=8, q_lora_rank=192, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        num_nextn_predict_layers=1, max_position_embeddings=2048, routed_scaling_factor=2.5,
    ),
}
PUBLIC_PRESETS = ("deepseek-v3", "deepseek-v2", "deepseek-v2-lite")
PRESETS = (*PUBLIC_PRESETS, *TRAINABLE_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named config: the public DeepSeek configs (verbatim copies of HF's) or a trainable size."""
    if name in TRAINABLE_PRESETS:
        return _small_moe(**TRAINABLE_PRESETS[name])
    if name in PUBLIC_PRESETS:
        return ModelConfig.from_json(CONFIGS_DIR / f"{name}.json")
    raise DSV3Error(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def load_config(source: str | os.PathLike) -> ModelConfig:
    """A preset name, a config.json, or a checkpoint folder holding one."""
    if isinstance(source, str) and source in PRESETS:
        return preset(source)
    return ModelConfig.from_json(source)
