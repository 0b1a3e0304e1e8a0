"""The DeepSeek-V3 model: MLA, DeepSeekMoE, MTP. One definition for training, inference and analysis."""

from dsv3.model.dispatch import ExpertRows, LocalDispatcher, Routing, TokenDispatcher
from dsv3.model.experts import FP8Experts, GroupedExperts, ResidentFP8Experts
from dsv3.model.mla import MLA, LatentCache
from dsv3.model.moe import MLP, MoE, Router
from dsv3.model.norm import RMSNorm
from dsv3.model.transformer import Block, LossOutput, MTPLayer, Transformer

__all__ = ["MLA", "MLP", "Block", "ExpertRows", "FP8Experts", "GroupedExperts", "LatentCache", "LocalDispatcher",
           "LossOutput", "MoE", "MTPLayer", "RMSNorm", "ResidentFP8Experts", "Router", "Routing", "TokenDispatcher",
           "Transformer"]
