"""Rotary position embedding with YaRN, in DeepSeek's interleaved layout.

DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ... of the decoupled RoPE dimensions. YaRN
(used for V2/V3 context extension) interpolates the low frequencies by ``factor``, keeps the high ones,
blends them over a linear ramp between the ``beta_fast``/``beta_slow`` correction dimensions, and scales
cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim). The softmax-scale half of YaRN's
correction lives in ``ModelConfig.softmax_scale``.
"""

from __future__ import annotations

import math

import torch

from dsv3.config import ModelConfig, yarn_mscale


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The RoPE dimension whose wavelength completes ``rotations`` turns over ``max_pos`` positions."""
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [rope_dim/2] fp32, cos/sin scale)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    low = math.floor(_correction_dim(rs.beta_fast, dim, base, rs.original_max_position_embeddings))
    high = math.ceil(_correction_dim(rs.beta_slow, dim, base, rs.original_max_position_embeddings))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate by factor
    inv_freq = inv_freq / rs.factor * (1 - keep) + inv_freq * keep
    scale = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return inv_freq, scale


def rope_angles(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [..., rope_dim/2] for integer ``positions`` of any shape, in fp32."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x: [B, T, H, R] by cos/sin: [B or 1, T, R/2] (computed in fp32)."""
    dtype = x.dtype
    x = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(dtype)
