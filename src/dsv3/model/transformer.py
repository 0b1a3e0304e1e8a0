"""The DeepSeek-V3 Transformer: blocks of MLA + (dense FFN | DeepSeekMoE), and the MTP modules.

Module names equal the HF checkpoint names (``model.layers.N.self_attn.kv_b_proj`` ...), so a state
dict is a checkpoint up to the routed experts, which are stored stacked here and per expert on disk.
The MTP modules sit at ``model.layers[num_hidden_layers + k]`` exactly as DeepSeek ships them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv3.config import ModelConfig
from dsv3.model.dispatch import Steps, run
from dsv3.model.init import init_
from dsv3.model.kernels import linear_cross_entropy, plain_cross_entropy
from dsv3.model.mla import MLA, LatentCache
from dsv3.model.moe import MLP, MoE
from dsv3.model.norm import RMSNorm
from dsv3.model.rope import inverse_frequencies, rope_angles


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos, sin, cache=None, start_pos=0, mask=None, absorb=None):
        return run(self.steps(x, cos, sin, cache, start_pos, mask, absorb))

    def steps(self, x: torch.Tensor, cos, sin, cache=None, start_pos=0, mask=None, absorb=None) -> Steps:
        """Generator: the block's forward, yielding while its MoE layer has an expert exchange in flight (so
        that another micro-batch computes meanwhile, ``dsv3.parallel.overlap``); returns [B, T, D]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start_pos, mask, absorb)
        h = self.post_attention_layernorm(x)
        return x + (yield from module_steps(self.mlp, h))


def module_steps(module: nn.Module, *args) -> Steps:
    """Generator: ``module(*args)`` through the module's own ``steps`` when it has them and nothing hooks
    its call (forward hooks, FSDP's class swap, a replaced forward such as activation checkpointing's, a
    stand-in module must see the call): then it yields while an exchange is in flight; otherwise the plain
    call, which never yields."""
    hooked = module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
    if type(module) in (Block, MoE) and not hooked:
        return (yield from module.steps(*args))
    return module(*args)


class SharedHead(nn.Module):
    """The MTP module's own final norm; the projection is the main model's output head (shared)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(Block):
    """One multi-token-prediction depth (V3 eqs. 21-23): h' = eh_proj([enorm(emb(t_{i+k})) ; hnorm(h_i)]),
    then a full Transformer block, then the shared head.

    Concatenation order: embedding first, hidden state second. That is the order of the released
    ``eh_proj`` weights as transformers, vLLM and SGLang load them (the V3 report's eq. 21 writes the
    hidden state first); we follow the weights so that DeepSeek's checkpoint predicts correctly.
    The embedding and output head are the main model's (shared, V3 §2.2).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, emb, h, cos, sin, cache=None, start_pos=0, mask=None, absorb=None):
        """emb: embeddings of tokens t_{i+k}, h: previous depth's hidden states, both [B, T, D].
        Returns this depth's hidden state (before shared_head.norm)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return super().forward(x, cos, sin, cache, start_pos, mask, absorb)


class DecoderStack(nn.Module):
    """``model.*`` of the checkpoint: embedding, main layers then MTP layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(n)] +
                                    [MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class LossOutput:
    loss: torch.Tensor  # what to backpropagate: lm + lambda * mtp + balance
    lm_loss: torch.Tensor
    mtp_loss: torch.Tensor | None
    balance_loss: torch.Tensor | None
    mtp_losses: list[torch.Tensor]  # per depth


class Transformer(nn.Module):
    """DeepSeek-V3 (and V2) for causal LM. ``model(input_ids)`` returns logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ---- structure ---------------------------------------------------------------------
    @property
    def main_layers(self) -> list[Block]:
        return list(self.model.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.config.num_hidden_layers :])

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for every matrix, ones for norms, zeros for router biases (`init_`),
        from torch's global generator. The trainer instead seeds each tensor by its name (`dsv3.model.init`)."""
        for name, p in self.named_parameters():
            init_(name, p, self.config.initializer_range)
        for moe in self.moe_layers():
            if moe.gate.e_score_correction_bias is not None:
                moe.gate.e_score_correction_bias.zero_()
        self.inv_freq.copy_(inverse_frequencies(self.config)[0])

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Create the non-persistent buffers (RoPE frequencies, expert-load counters) on ``device`` (default:
        the parameters'): what a model built on the meta device and filled with ``load_state_dict(...,
        assign=True)`` still lacks, since state dicts do not carry them."""
        device = next(self.parameters()).device if device is None else device
        self.inv_freq = inverse_frequencies(self.config)[0].to(device)
        for moe in self.moe_layers():
            moe.expert_load = torch.zeros(moe.n_experts, device=device)

    # ---- forward -----------------------------------------------------------------------
    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(self.inv_freq, self.rope_scale, positions)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: LatentCache | None = None, start_pos: int = 0,
                      mask: torch.Tensor | None = None, absorb: bool | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, D] of the main model (what the head and MTP read)."""
        return run(self.hidden_steps(input_ids, positions, cache, start_pos, mask, absorb))

    def hidden_steps(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                     cache: LatentCache | None = None, start_pos: int = 0,
                     mask: torch.Tensor | None = None, absorb: bool | None = None) -> Steps:
        """Generator of ``hidden_states``: yields while an MoE layer's expert exchange is in flight, so that
        two micro-batches of rows can overlap one's compute with the other's exchange (dual micro-batch
        decode, ``dsv3.infer.engine``); returns the final normed hidden states [B, T, D]."""
        T = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)[None]
        cos, sin = self.angles(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.main_layers:
            x = yield from module_steps(layer, x, cos, sin, cache, start_pos, mask, absorb)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]. kwargs: positions, cache, start_pos, mask, absorb."""
        return self.hidden_and_logits(input_ids, **kwargs)[1]

    def hidden_and_logits(self, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states, the head's logits of them): what a decode step needs (MTP drafts from the hidden
        states). ``dsv3.kernels.decode.FastDecode`` computes the pair in one call."""
        h = self.hidden_states(input_ids, **kwargs)
        return h, self.lm_head(h)

    def mtp_hidden(self, depth: int, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   cache: LatentCache | None = None, start_pos: int = 0, mask=None, absorb=None) -> torch.Tensor:
        """Depth ``depth`` (0-based) of MTP: from hidden states h [B, T, D] of the previous depth and the
        tokens next_ids [B, T] that follow them by ``depth + 1``, this depth's hidden states [B, T, D]."""
        layer = self.mtp_layers[depth]
        cos, sin = self.angles(positions)
        emb = getattr(layer, "embed_tokens", self.model.embed_tokens)(next_ids)
        return layer(emb, h, cos, sin, cache, start_pos, mask, absorb)

    def mtp_logits(self, depth: int, h_mtp: torch.Tensor) -> torch.Tensor:
        return self._mtp_head(depth)(self.mtp_layers[depth].shared_head.norm(h_mtp))

    def _mtp_head(self, depth: int) -> nn.Module:
        """The output head of MTP depth ``depth``: its own copy when the checkpoint kept one, else lm_head."""
        return getattr(self.mtp_layers[depth].shared_head, "head", self.lm_head)

    def _head_loss(self, head: nn.Module, h: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Cross-entropy of head(h): fused with the head when it is a plain linear layer
        (`kernels.linear_cross_entropy`), else through the materialized logits (an FP8 or hooked head)."""
        if type(head) is nn.Linear and head.bias is None and not head._forward_hooks:
            return linear_cross_entropy(h, head.weight, labels, ignore_index)
        return plain_cross_entropy(head(h), labels, ignore_index)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        """Training objective. labels[b, t] is the token after input_ids[b, t].

        MTP depth k (1-based) at position i reads token input_ids[i + k] and predicts labels[i + k]
        (= token i + k + 1), over the T - k positions where that exists (V3 eqs. 21-25).
        """
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)[None]
        h = self.hidden_states(input_ids, positions=positions)
        lm_loss = self._head_loss(self.lm_head, h, labels, ignore_index)
        mtp_losses = []
        for k in range(1, len(self.mtp_layers) + 1):
            if T - k <= 0:
                break
            h = self.mtp_hidden(k - 1, h[:, : T - k], input_ids[:, k:], positions[:, : T - k])
            h_normed = self.mtp_layers[k - 1].shared_head.norm(h)
            mtp_losses.append(self._head_loss(self._mtp_head(k - 1), h_normed, labels[:, k:], ignore_index))
        total = lm_loss
        mtp_loss = None
        if mtp_losses:
            mtp_loss = torch.stack(mtp_losses).mean()
            total = total + self.config.mtp_loss_weight * mtp_loss
        balance = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        balance_loss = torch.stack(balance).sum() if balance and self.training else None
        if balance_loss is not None:
            total = total + balance_loss
        for m in self.moe_layers():
            m.aux_loss = None
        return LossOutput(total, lm_loss, mtp_loss, balance_loss, mtp_losses)

    @torch.no_grad()
    def update_router_biases(self, speed: float | None = None) -> list[float]:
        """Apply the aux-loss-free bias update to every MoE layer from the loads seen since the last
        call; returns each layer's max/mean load."""
        speed = self.config.bias_update_speed if speed is None else speed
        return [m.update_bias(speed)["max_over_mean"] for m in self.moe_layers()]

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> LatentCache:
        dtype = dtype or next(self.parameters()).dtype
        return LatentCache(self.config, batch_size, max_len, dtype=dtype, device=self.inv_freq.device)

    def save_pretrained(self, path, **kwargs) -> None:
        """``dsv3.checkpoint.save_pretrained(self, path, **kwargs)``: HF-layout safetensors in DeepSeek's
        names. The checkpoint layer knows the model, not the reverse: imported here, on call only."""
        from dsv3.checkpoint import save_pretrained

        save_pretrained(self, path, **kwargs)

