"""Multi-head Latent Attention (V2 §2.1, V3 §2.1.1) with its two paths over one set of weights.

* Expanded (train / prefill): K and V are expanded from the latent c_KV by W_UK / W_UV (``kv_b_proj``)
  and attention is ordinary multi-head attention over [k_nope ; k_rope].
* Absorbed (decode): W_UK is folded into the query and W_UV applied after attention, so attention runs
  directly against the cached latent. The cache holds only kv_lora_rank + qk_rope_head_dim values per
  token per layer: the normalised c_KV and the roped shared key k_R.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv3.config import ModelConfig
from dsv3.model.kernels import attention_core, causal_mask
from dsv3.model.norm import RMSNorm
from dsv3.model.rope import apply_rope


class LatentCache:
    """Preallocated latent KV cache for all layers: c_KV [L, B, S, r] and k_R [L, B, S, rope]."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, layers: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers if layers is None else layers
        shapes = (layers, batch_size, max_len, cfg.kv_lora_rank), (layers, batch_size, max_len, cfg.qk_rope_head_dim)
        # Ordinary pages, not huge ones (``dsv3.model.huge_pages``, which the weights use): a server allocates a
        # cache whenever rows join or leave its batch, and with THP's usual ``defrag`` setting (madvise) each
        # first touch of an advised huge page may stall in compaction, for as long as memory's fragmentation
        # makes it (``benchmarks/batch_join.py``: merging a 4,000-token row took 48 ms before, 10 ms now).
        self.kv, self.pe = (torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)

    @property
    def max_len(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.pe.nbytes

    def bytes_per_token_per_layer(self) -> int:
        return (self.kv.shape[-1] + self.pe.shape[-1]) * self.kv.element_size()

    def write(self, layer: int, start: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        end = start + c_kv.shape[1]
        if end > self.max_len:
            raise ValueError(f"cache overflow: writing up to position {end} in a cache of {self.max_len}")
        self.kv[layer, : c_kv.shape[0], start:end] = c_kv.to(self.kv.dtype)
        self.pe[layer, : k_pe.shape[0], start:end] = k_pe.to(self.pe.dtype)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        d, h, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=bias)

    # ---- projections -------------------------------------------------------------------
    def _query(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, T, H, nope], roped q_pe [B, T, H, rope]."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (self.n_heads, self.nope + self.rope))
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin)

    def latent(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds: normalised c_KV [B, T, r] and roped shared key k_R [B, T, rope]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        return self.kv_a_layernorm(c_kv), k_pe

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] and W_UV [H, v, r], views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, : self.nope], w[:, self.nope :]

    # ---- attention ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None, start_pos: int = 0,
                mask: torch.Tensor | None = None, absorb: bool | None = None) -> torch.Tensor:
        """x: [B, T, D] at positions given by cos/sin [B|1, T, rope/2]; mask: bool [B, T, S] (True = attend).

        Without a cache: expanded causal attention over x itself. With a cache: the new latents are
        written at [start_pos, start_pos + T) and attention covers [0, start_pos + T); by default the
        first chunk (start_pos == 0) uses the expanded path and later chunks the absorbed one.
        """
        q_nope, q_pe = self._query(x, cos, sin)
        c_kv, k_pe = self.latent(x, cos, sin)
        if cache is not None:
            cache.write(self.layer_idx, start_pos, c_kv, k_pe)
            end = start_pos + x.shape[1]
            c_kv = cache.kv[self.layer_idx, : x.shape[0], :end].to(x.dtype)
            k_pe = cache.pe[self.layer_idx, : x.shape[0], :end].to(x.dtype)
        if absorb is None:
            absorb = cache is not None and start_pos > 0
        attend = self._absorbed if absorb else self._expanded
        out = attend(q_nope, q_pe, c_kv, k_pe, start_pos, mask)  # [B, T, H, v]
        return self.o_proj(out.flatten(2))

    def _expanded(self, q_nope, q_pe, c_kv, k_pe, start_pos, mask) -> torch.Tensor:
        B, T, H, _ = q_nope.shape
        k_nope, v = self.kv_b_proj(c_kv).unflatten(-1, (H, self.nope + self.v_dim)).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, H, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T|S, d]
        full = None if mask is None and start_pos == 0 and k.shape[2] == T else causal_mask(
            T, k.shape[2], start_pos, q.device, mask).unsqueeze(1)
        return attention_core(q, k, v, self.scale, full).transpose(1, 2)

    def _absorbed(self, q_nope, q_pe, c_kv, k_pe, start_pos, mask) -> torch.Tensor:
        full = causal_mask(q_nope.shape[1], c_kv.shape[1], start_pos, q_nope.device, mask)
        return self.latent_attention(q_nope, q_pe, c_kv, k_pe, full)

    def latent_attention(self, q_nope, q_pe, c_kv, k_pe, allowed: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of queries q_nope [B, T, H, nope], q_pe [B, T, H, rope] over latents c_kv
        [B, S, r], k_pe [B, S, rope]; ``allowed`` bool [B|1, T, S] says which keys each query sees.
        Returns [B, T, H, v]."""
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # query in the latent space
        scores = torch.einsum("bthr,bsr->bhts", q_lat, c_kv) + torch.einsum("bthp,bsp->bhts", q_pe, k_pe)
        scores = (scores.float() * self.scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = scores.softmax(dim=-1).to(c_kv.dtype)
        o_lat = torch.einsum("bhts,bsr->bthr", probs, c_kv)
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
