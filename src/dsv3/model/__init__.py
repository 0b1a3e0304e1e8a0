"""The DeepSeek-V3 model: MLA, DeepSeekMoE, MTP. One definition for training, inference and analysis."""

from dsv3.model.mla import MLA, LatentCache
from dsv3.model.moe import MLP, Experts, MoE, Router
from dsv3.model.norm import RMSNorm
from dsv3.model.transformer import Block, LossOutput, MTPLayer, Transformer

__all__ = ["MLA", "MLP", "Block", "Experts", "LatentCache", "LossOutput", "MoE", "MTPLayer", "RMSNorm",
           "Router", "Transformer"]
