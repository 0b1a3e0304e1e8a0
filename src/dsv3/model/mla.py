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
    """The latent KV cache of a batch of rows for all layers, in pages of ``page_tokens`` slots:
    c_KV ``kv`` [L, P, page_tokens, r] and k_R ``pe`` [L, P, page_tokens, rope].

    The rows of a batch share one slot counter (a step writes every row at the same slot), so a row's
    slot ``s`` is found through its page table: at physical position ``q = s - shift[b]`` of the row, in
    page ``table[b, q // page_tokens]`` at offset ``q % page_tokens`` (a page of -1: none mapped). A merge
    that right-aligns a row beside longer ones only adds to its shift, and pages can be shared by rows
    that start with the same tokens, so neither moves a byte. The slots a row does not hold (``q`` < 0, or
    an unmapped page) are masked out of its attention by the engine, and read as page ``blank``'s first
    slot, which the pool keeps at zero: a masked key still multiplies its value by a zero weight, and the
    garbage of a freed page (NaN, say) must not reach the output as 0 * NaN.

    ``LatentCache(cfg, B, S)`` is the plain case: one page per row holding all its slots (``table`` None:
    row b is page b, shift 0), the layout [L, B, S, r] the module path and the static step index directly.
    ``LatentCache.paged`` views pages of a shared pool through a table.
    """

    table: torch.Tensor | None = None  # int32 [B, pages per row]; None: row b is page b
    shift: torch.Tensor | None = None  # int64 [B]
    blank: int = 0  # a page of zeros: what the slots a row does not hold read (paged caches)

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, layers: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers if layers is None else layers
        shapes = (layers, batch_size, max_len, cfg.kv_lora_rank), (layers, batch_size, max_len, cfg.qk_rope_head_dim)
        # Ordinary pages, not huge ones (``dsv3.model.huge_pages``, which the weights use): with THP's usual
        # ``defrag`` setting (madvise) each first touch of an advised huge page may stall in compaction, for as
        # long as memory's fragmentation makes it (``benchmarks/batch_join.py``: merging a 4,000-token row into
        # a batch whose new cache sat on huge pages took 48 ms, 10 ms on ordinary ones).
        self.kv, self.pe = (torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)

    @classmethod
    def paged(cls, kv: torch.Tensor, pe: torch.Tensor, table: torch.Tensor, shift: torch.Tensor,
              blank: int = 0) -> LatentCache:
        """Rows ``table`` [B, n] (int32 page numbers, -1: none) of the pages kv [L, P, page_tokens, r] and pe
        [L, P, page_tokens, rope], each row's slots shifted right by ``shift`` [B] (int64); page ``blank``
        holds zeros (no row's)."""
        if table.dim() != 2 or shift.shape != (table.shape[0],) or kv.shape[:3] != pe.shape[:3]:
            raise ValueError(f"page table {tuple(table.shape)}, shift {tuple(shift.shape)} and pages "
                             f"{tuple(kv.shape)}/{tuple(pe.shape)} do not fit")
        cache = cls.__new__(cls)
        cache.kv, cache.pe = kv, pe
        cache.table, cache.shift = table.to(torch.int32).contiguous(), shift.to(torch.int64).contiguous()
        cache.blank, cache._max_len = blank, None
        return cache

    @property
    def page_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def rows(self) -> int:
        return self.kv.shape[1] if self.table is None else self.table.shape[0]

    @property
    def max_len(self) -> int:
        """Slots every row can write below: the smallest of shift + mapped pages' slots over the rows (of a
        paged cache, worked out once: its table and shifts do not change, the engine makes a new one)."""
        if self.table is None:
            return self.kv.shape[2]
        if self._max_len is None:
            mapped = (self.table >= 0).sum(1).to(torch.int64)
            self._max_len = int((self.shift + mapped * self.page_tokens).min()) if self.rows else 0
        return self._max_len

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.pe.nbytes

    def bytes_per_token_per_layer(self) -> int:
        return (self.kv.shape[-1] + self.pe.shape[-1]) * self.kv.element_size()

    def select(self, rows: slice) -> LatentCache:
        """A view of some rows: what it writes lands in this cache."""
        if self.table is None:
            view = LatentCache.__new__(LatentCache)
            view.kv, view.pe = self.kv[:, rows], self.pe[:, rows]
            return view
        return LatentCache.paged(self.kv, self.pe, self.table[rows], self.shift[rows], self.blank)

    def slots(self, rows: int, start: int, end: int) -> torch.Tensor:
        """Where slots [start, end) of rows [0, rows) lie: flat indices [rows, end - start] into the pages'
        slots (page * page_tokens + offset), -1 for a slot the row does not hold. Paged caches only."""
        n = self.page_tokens
        q = torch.arange(start, end, device=self.table.device)[None, :] - self.shift[:rows, None]
        col = q.div(n, rounding_mode="floor").clamp(0, self.table.shape[1] - 1)
        page = self.table[:rows].to(torch.int64).gather(1, col)
        inside = (q >= 0) & (q < self.table.shape[1] * n) & (page >= 0)
        return torch.where(inside, page * n + q % n, torch.full_like(q, -1))

    def _blank_for_unheld(self, at: torch.Tensor) -> torch.Tensor:
        return torch.where(at < 0, self.blank * self.page_tokens, at).to(self.kv.device)

    def write(self, layer: int, start: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write c_kv [B, T, r] and k_pe [B, T, rope] at slots [start, start + T) of rows [0, B); in a paged
        cache the slots before a row's shift (left padding) are not stored, and any other slot outside its
        pages is an error."""
        end = start + c_kv.shape[1]
        if end > self.max_len:
            raise ValueError(f"cache overflow: writing up to position {end} in a cache of {self.max_len}")
        if self.table is None:
            self.kv[layer, : c_kv.shape[0], start:end] = c_kv.to(self.kv.dtype)
            self.pe[layer, : k_pe.shape[0], start:end] = k_pe.to(self.pe.dtype)
            return
        at = self.slots(c_kv.shape[0], start, end)
        before = torch.arange(start, end)[None, :] < self.shift[: c_kv.shape[0], None]
        if bool(((at < 0) & ~before).any()):
            raise ValueError(f"cache write at slots [{start}, {end}) outside a row's pages")
        keep = (at >= 0).flatten().to(self.kv.device)  # slots before a row's shift (its padding) are not kept
        at = at.flatten().to(self.kv.device)[keep]
        self.kv[layer].flatten(0, 1)[at] = c_kv.flatten(0, 1)[keep].to(self.kv.dtype)
        self.pe[layer].flatten(0, 1)[at] = k_pe.flatten(0, 1)[keep].to(self.pe.dtype)

    def row_slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Where slots [start, end) of one row lie, as ``slots`` gives them. Paged caches only."""
        return LatentCache.paged(self.kv, self.pe, self.table[row : row + 1], self.shift[row : row + 1],
                                 self.blank).slots(1, start, end)[0]

    def read_row(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's c_KV [L, end - start, r] and k_R [L, end - start, rope] of one row's slots [start, end)
        (a copy; slots the row does not hold read as zeros, from the blank page)."""
        if self.table is None:
            return self.kv[:, row, start:end].clone(), self.pe[:, row, start:end].clone()
        at = self._blank_for_unheld(self.row_slots(row, start, end))
        return self.kv.flatten(1, 2)[:, at], self.pe.flatten(1, 2)[:, at]

    def write_row(self, row: int, start: int, kv: torch.Tensor, pe: torch.Tensor, first_layer: int = 0) -> None:
        """Write kv [l, n, r] and pe [l, n, rope] into layers [first_layer, first_layer + l) of one row at slots
        [start, start + n) (every one of them the row's)."""
        layers = slice(first_layer, first_layer + kv.shape[0])
        if self.table is None:
            self.kv[layers, row, start : start + kv.shape[1]] = kv.to(self.kv.dtype)
            self.pe[layers, row, start : start + pe.shape[1]] = pe.to(self.pe.dtype)
            return
        at = self.row_slots(row, start, start + kv.shape[1])
        if bool((at < 0).any()):
            raise ValueError(f"cache write at slots [{start}, {start + kv.shape[1]}) outside row {row}'s pages")
        at = at.to(self.kv.device)
        self.kv.flatten(1, 2)[layers, at] = kv.to(self.kv.dtype)
        self.pe.flatten(1, 2)[layers, at] = pe.to(self.pe.dtype)

    def read(self, layer: int, rows: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """c_KV [rows, end, r] and k_R [rows, end, rope] of slots [0, end) (a view of the plain cache; a
        gather of a paged one, whose slots a row does not hold read as zeros, from the blank page)."""
        if self.table is None:
            return self.kv[layer, :rows, :end], self.pe[layer, :rows, :end]
        at = self._blank_for_unheld(self.slots(rows, 0, end))
        return self.kv[layer].flatten(0, 1)[at], self.pe[layer].flatten(0, 1)[at]


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
            c_kv, k_pe = (t.to(x.dtype) for t in cache.read(self.layer_idx, x.shape[0], start_pos + x.shape[1]))
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
