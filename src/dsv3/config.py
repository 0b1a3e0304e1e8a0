"""`ModelConfig`: every field of a DeepSeek V2/V3 Hugging Face ``config.json``, validated, with presets.

One dataclass serves the model, training, inference and the analyzer. Field names are the HF names, so a
config.json maps onto it key for key. Two rope layouts are read: the old one DeepSeek ships
(``rope_theta`` + ``rope_scaling``) and the new one transformers 5 writes (``rope_parameters``).
A few training knobs that no HF config carries (balancing speed, balance-loss alpha, MTP loss weight)
live here too, with the V3 report's values as defaults, and are written as extra keys that HF ignores.

Fields missing from a config.json take the defaults of its ``model_type`` as transformers' config class
and modeling code read them (``MODEL_TYPE_DEFAULTS``): a V2 config has softmax scores, greedy routing and
no MTP layer, a V3 one sigmoid scores, ``noaux_tc`` and one MTP layer. Every field is type-checked, and
sizes are bounded by ``LIMITS`` (far above any published model: 1,024 layers, 16,384 routed experts,
4M vocabulary, ...), so a corrupt or hostile config is refused with one line naming the field instead of
exhausting memory later.
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
MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
CONFIGS_DIR = Path(__file__).parent / "configs"

# Integer fields: (smallest allowed, largest allowed, null allowed). The upper bounds are dsv3's own, far
# above any published model (DeepSeek-V3: 61 layers, 256 experts, 129,280 tokens), so that a corrupt
# config cannot make the analyzer or the meta-device model build loop for hours or exhaust memory.
LIMITS: dict[str, tuple[int, int, bool]] = {
    "vocab_size": (1, 1 << 22, False),
    "hidden_size": (1, 1 << 16, False),
    "intermediate_size": (1, 1 << 18, False),
    "moe_intermediate_size": (1, 1 << 18, False),
    "num_hidden_layers": (1, 1 << 10, False),
    "num_attention_heads": (1, 1 << 10, False),
    "num_key_value_heads": (1, 1 << 10, True),
    "q_lora_rank": (1, 1 << 16, True),
    "kv_lora_rank": (1, 1 << 16, False),
    "qk_nope_head_dim": (0, 1 << 12, False),
    "qk_rope_head_dim": (1, 1 << 12, False),
    "v_head_dim": (1, 1 << 12, False),
    "n_routed_experts": (0, 1 << 14, True),
    "n_shared_experts": (0, 1 << 10, True),
    "num_experts_per_tok": (1, 1 << 14, True),
    "n_group": (1, 1 << 14, True),
    "topk_group": (1, 1 << 14, True),
    "first_k_dense_replace": (0, 1 << 10, False),
    "moe_layer_freq": (1, 1 << 10, False),
    "num_nextn_predict_layers": (0, 1 << 6, False),
    "max_position_embeddings": (1, 1 << 24, False),
    "bos_token_id": (0, 1 << 31, True),
}
# Other families' names for the same sizes (the analyzer reads Llama, Qwen and Mixtral configs).
LIMITS_BY_HF_NAME: dict[str, int] = {
    **{name: hi for name, (_, hi, _) in LIMITS.items()},
    "num_local_experts": 1 << 14, "num_experts": 1 << 14, "head_dim": 1 << 12, "decoder_sparse_step": 1 << 10,
    "shared_expert_intermediate_size": 1 << 18,
}
# Float fields: (must be > 0 rather than >= 0).
FLOATS: dict[str, bool] = {"rms_norm_eps": True, "routed_scaling_factor": True, "rope_theta": True,
                           "initializer_range": False, "bias_update_speed": False, "aux_loss_alpha": False,
                           "mtp_loss_weight": False}
BOOLS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias")
STRINGS = ("topk_method", "scoring_func", "hidden_act", "torch_dtype", "model_type")

# Defaults for fields a config.json leaves out, per model_type, as transformers 5 reads them: the values
# of DeepseekV2Config/DeepseekV3Config, and for the fields those classes lack, what the modeling code
# does regardless of config (V2 always scores with softmax and has no MTP layer; V3 always uses sigmoid
# scores with noaux_tc group routing). DeepSeek's own configuration_deepseek.py agrees on every field
# that changes the logits. ``ModelConfig``'s dataclass defaults are the V3 column.
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"num_nextn_predict_layers": 1},
    "deepseek_v2": {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
        "num_hidden_layers": 32, "num_attention_heads": 32, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": None, "n_group": None, "topk_group": None, "topk_method": "greedy",
        "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    },
}


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
    eos_token_id: int | list[int] | None = 1  # HF allows a list: generation stops at any of them
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
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id: ``eos_token_id`` may be one id, a list of them, or null."""
        eos = self.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset(eos) if isinstance(eos, list) else frozenset([eos])

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
        """Every inconsistency, one message each; empty when the config is usable. Types and bounds come
        first: when a field has the wrong type, the consistency checks (which compare fields) are skipped."""
        p = self._type_problems()
        if p:
            return p
        if self.qk_rope_head_dim % 2:
            p.append(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.topk_method not in TOPK_METHODS:
            p.append(f"unknown topk_method {self.topk_method!r}; expected one of {', '.join(TOPK_METHODS)}")
        if self.scoring_func not in SCORING_FUNCS:
            p.append(f"unknown scoring_func {self.scoring_func!r}; expected one of {', '.join(SCORING_FUNCS)}")
        if self.hidden_act != "silu":
            p.append(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.model_type not in MODEL_TYPES:
            p.append(f"unsupported model_type {self.model_type!r}; expected one of {', '.join(MODEL_TYPES)}")
        if self.has_moe:
            p += self._moe_problems()
        p += self._rope_problems() + self._unsupported_layout_problems()
        return p

    def _type_problems(self) -> list[str]:
        """Wrong JSON types, nulls where a value is needed, negative or absurd sizes, non-finite floats."""
        p = [msg for name, (lo, hi, nullable) in LIMITS.items()
             if (msg := _int_problem(name, getattr(self, name), lo, hi, nullable))]
        p += [msg for name, positive in FLOATS.items() if (msg := _float_problem(name, getattr(self, name), positive))]
        p += [f"{name} must be true or false, got {_show(getattr(self, name))}"
              for name in BOOLS if not isinstance(getattr(self, name), bool)]
        p += [f"{name} must be a string, got {_show(getattr(self, name))}"
              for name in STRINGS if not isinstance(getattr(self, name), str)]
        p += _eos_problems(self.eos_token_id)
        if self.quantization_config is not None and not isinstance(self.quantization_config, dict):
            p.append(f"quantization_config must be an object or null, got {_show(self.quantization_config)}")
        rs = self.rope_scaling
        if rs is not None and not isinstance(rs, RopeScaling):
            p.append(f"rope_scaling must be an object or null, got {_show(rs)}")
        elif rs is not None:
            p += [msg for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
                  if (msg := _float_problem(f"rope_scaling.{name}", getattr(rs, name), name == "factor"))]
            lo, hi, _ = LIMITS["max_position_embeddings"]
            msg = _int_problem("rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings,
                               lo, hi, False)
            p += [msg] if msg else []
            if not isinstance(rs.type, str):
                p.append(f"rope_scaling.type must be a string, got {_show(rs.type)}")
        return p

    def _rope_problems(self) -> list[str]:
        rs = self.rope_scaling
        if rs is None or rs.type == "yarn":
            return []
        return [f"rope scaling type {rs.type!r} is not supported; DeepSeek uses 'yarn'"]

    def _unsupported_layout_problems(self) -> list[str]:
        """Fields dsv3 reads but does not implement, refused rather than silently computed otherwise."""
        p = []
        if self.extra.get("rope_interleave", True) is not True:
            p.append("rope_interleave false (rotate-half RoPE weights) is not supported; dsv3 reads DeepSeek's "
                     "interleaved layout (rope_interleave: true)")
        if self.extra.get("mlp_bias", False) is not False:
            p.append("mlp_bias true is not supported: DeepSeek's feed-forward layers have no biases")
        q = self.quantization_config
        if q is not None and (q.get("quant_method") != "fp8" or q.get("weight_block_size", [128, 128]) != [128, 128]
                              or q.get("fmt", "e4m3") != "e4m3"):
            p.append("quantization_config: only DeepSeek's FP8 scheme (quant_method fp8, fmt e4m3, "
                     f"weight_block_size [128, 128]) is supported, got {_show(q)}")
        if (self.model_type == "deepseek_v2" and self.has_moe and self.norm_topk_prob
                and self.routed_scaling_factor != 1.0):
            p.append("deepseek_v2 with norm_topk_prob true and routed_scaling_factor != 1 is ambiguous: DeepSeek's "
                     "V2 code normalizes without scaling, transformers scales without normalizing")
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
        return p

    def validate(self, where: str = "invalid model config") -> ModelConfig:
        """``self``, or one DSV3Error line ``where: problem; problem``."""
        problems = self.problems()
        if problems:
            raise DSV3Error(f"{where}: " + "; ".join(problems))
        return self

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """From a HF config dict in either rope layout; fields it leaves out take the defaults of its
        ``model_type`` (``MODEL_TYPE_DEFAULTS``); unknown keys are kept in ``extra``. Not validated."""
        data = dict(data)
        _fold_rope_keys(data)
        if "num_mtp_layers" in data:  # transformers 5's alias
            data.setdefault("num_nextn_predict_layers", data.pop("num_mtp_layers"))
        model_type = data.get("model_type", "deepseek_v3")
        for key, value in MODEL_TYPE_DEFAULTS.get(model_type if isinstance(model_type, str) else "", {}).items():
            data.setdefault(key, value)
        if "norm_topk_prob" in data and data["norm_topk_prob"] is None:
            data["norm_topk_prob"] = False  # transformers and DeepSeek's code both read null as "do not normalize"
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
        """A validated config from ``path`` (or ``path/config.json``); problems are reported against the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        data = read_json_object(path)
        try:
            cfg = cls.from_dict(data)
        except DSV3Error as exc:
            raise DSV3Error(f"{path}: {exc}") from None
        return cfg.validate(where=str(path))

    def save_json(self, path: str | os.PathLike, rope_layout: str = "old") -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        atomic_write_text(path, json.dumps(self.to_dict(rope_layout), indent=2) + "\n")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1 (1 when not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _fold_rope_keys(data: dict[str, Any]) -> None:
    """transformers 5's ``rope_parameters`` -> DeepSeek's ``rope_theta`` + ``rope_scaling``; an unscaled
    ("default") rope becomes ``rope_scaling: null``. Refuses a rope entry that is not a JSON object."""
    params = data.pop("rope_parameters", None)
    if params is not None and not isinstance(params, dict):
        raise DSV3Error(f"rope_parameters must be an object or null, got {_show(params)}")
    if params:
        params = dict(params)
        data.setdefault("rope_theta", params.pop("rope_theta", 10000.0))
        data["rope_scaling"] = params
        params.setdefault("rope_type", params.get("type", "default"))
    scaling = data.get("rope_scaling")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise DSV3Error(f"rope_scaling must be an object or null, got {_show(scaling)}")
    if scaling.get("type", scaling.get("rope_type")) == "default":
        data["rope_scaling"] = None


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


def _show(value: Any, width: int = 60) -> str:
    """A config value as a user reads it in an error line: JSON's null/true/false, long values cut."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _int_problem(name: str, value: Any, lo: int, hi: int, nullable: bool) -> str | None:
    """Why ``value`` is not an acceptable integer for ``name`` (None when it is)."""
    if value is None:
        return None if nullable else f"{name} must be an integer, got null"
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name} must be an integer{' or null' if nullable else ''}, got {_show(value)}"
    if value < lo:
        return f"{name} must be a positive integer, got {value}" if lo == 1 else f"{name} must be >= {lo}, got {value}"
    if value > hi:
        return f"{name} = {_show(value)} exceeds dsv3's limit of {hi:,} (dsv3.config.LIMITS)"
    return None


def _float_problem(name: str, value: Any, positive: bool) -> str | None:
    """Why ``value`` is not an acceptable finite number for ``name`` (None when it is)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{name} must be a number, got {_show(value)}"
    if not math.isfinite(value):
        return f"{name} must be finite, got {value}"
    if value < 0 or (positive and value == 0):
        return f"{name} must be {'> 0' if positive else '>= 0'}, got {value}"
    return None


def _eos_problems(eos: Any) -> list[str]:
    ids = eos if isinstance(eos, list) else [eos]
    if eos is None or all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
        return []
    return [f"eos_token_id must be a token id, a list of token ids or null, got {_show(eos)}"]


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
