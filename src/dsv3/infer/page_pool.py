"""The pages of the latent cache that every batch of an engine takes its rows' slots from.

A batch's cache is a page table over this pool (``dsv3.model.mla.LatentCache.paged``): a row takes pages
as it grows and gives them back when it ends, merging two batches concatenates their tables, and rows
that share a prompt share the pages it fills. The pool is one allocation of ``max_bytes`` made up front
(as vLLM's CPU backend reserves its KV cache space): untouched pages cost address space, not memory, and
a page is zeroed when it is handed out, so that a slot nobody wrote reads as zero, never as garbage (a
masked key still multiplies its value by a zero weight, and 0 * NaN is NaN). When every page is taken,
``take`` raises ``PoolFull``: the scheduler then lets new requests wait and preempts running ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv3.errors import DSV3Error
from dsv3.model.mla import LatentCache

DEFAULT_PAGE_TOKENS = 16
DEFAULT_POOL_BYTES = 4 * 1024**3
BLANK = 0  # the page of zeros


class PoolFull(DSV3Error):
    """Fewer free pages than asked for; nothing was taken."""

    def __init__(self, wanted: int, free: int):
        super().__init__(f"the latent cache has {free} free pages, {wanted} wanted (--kv-cache-bytes sets its size)")
        self.wanted, self.free = wanted, free

    @staticmethod
    def alone(tokens: int) -> DSV3Error:
        """The error of a request that does not fit even with the whole cache to itself."""
        return DSV3Error(f"a context of {tokens} tokens does not fit in the latent cache: raise --kv-cache-bytes")


class PagePool:
    """``pages`` pages of ``page_tokens`` slots for every layer of the cache: kv [L, pages, page_tokens, r],
    pe [L, pages, page_tokens, rope]; each page is free or held by one or more owners (reference counts)."""

    def __init__(self, model, max_bytes: int, page_tokens: int = DEFAULT_PAGE_TOKENS,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        if page_tokens < 1:
            raise DSV3Error(f"a cache page must hold >= 1 token, got {page_tokens}")
        cfg = model.config
        dtype = dtype or next(model.parameters()).dtype
        self.layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        self.page_tokens = page_tokens
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.page_bytes = self.layers * page_tokens * width * torch.empty(0, dtype=dtype).element_size()
        pages = max_bytes // self.page_bytes - 1  # the blank page counts too
        if pages < 1:
            raise DSV3Error(f"--kv-cache-bytes {max_bytes} holds fewer than 2 pages of the latent cache "
                            f"({self.page_bytes} bytes each: {page_tokens} tokens of every layer; one stays blank)")
        device = device if device is not None else model.inv_freq.device
        # page 0 is BLANK, zeros for good: what the slots a row does not hold read (LatentCache.paged)
        try:
            self.kv = torch.empty(self.layers, pages + 1, page_tokens, cfg.kv_lora_rank, dtype=dtype, device=device)
            self.pe = torch.empty(self.layers, pages + 1, page_tokens, cfg.qk_rope_head_dim, dtype=dtype,
                                  device=device)
        except (RuntimeError, MemoryError) as exc:  # more than the system lets this process reserve
            raise DSV3Error(f"cannot reserve {max_bytes:,} bytes for the latent cache: the system refused "
                            f"({type(exc).__name__}); lower --kv-cache-bytes") from None
        self.kv[:, BLANK], self.pe[:, BLANK] = 0, 0
        self.refs = [0] * (pages + 1)
        self._free = list(range(pages, BLANK, -1))  # pop() hands out the lowest page first
        self.reclaim: Callable[[int], None] | None = None  # asked to free pages before take refuses (prefix cache)

    @property
    def pages(self) -> int:
        """Pages that requests and the prefix cache can hold (the blank page aside)."""
        return len(self.refs) - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def take(self, n: int) -> list[int]:
        """``n`` zeroed pages, each held once; PoolFull (nothing taken) when fewer are free, even after
        ``reclaim``."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n)
        if n > len(self._free):
            raise PoolFull(n, len(self._free))
        taken = [self._free.pop() for _ in range(n)]
        if taken:
            at = torch.tensor(taken, device=self.kv.device)
            self.kv[:, at] = 0
            self.pe[:, at] = 0
        for page in taken:
            self.refs[page] = 1
        return taken

    def hold(self, pages: list[int]) -> None:
        """One more owner for each page (a row sharing another's prompt, the prefix cache)."""
        for page in pages:
            self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """One owner fewer for each page; a page nobody holds is free again."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free.append(page)
            elif self.refs[page] < 0:
                raise RuntimeError(f"page {page} released more often than held")

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy pages ``src`` onto ``dst`` (every layer)."""
        if src:
            s, d = (torch.tensor(p, device=self.kv.device) for p in (src, dst))
            self.kv[:, d] = self.kv[:, s]
            self.pe[:, d] = self.pe[:, s]

    def cache(self, tables: list[list[int]], shifts: list[int]) -> LatentCache:
        """The LatentCache of rows whose pages are ``tables`` (ragged: padded with -1) shifted by ``shifts``
        (the table stays on the CPU, where the kernels and the bookkeeping read it)."""
        width = max((len(t) for t in tables), default=0)
        table = torch.full((len(tables), max(width, 1)), -1, dtype=torch.int32)
        for b, pages in enumerate(tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return self.rows(table, torch.tensor(shifts, dtype=torch.int64))

    def rows(self, table: torch.Tensor, shifts: torch.Tensor) -> LatentCache:
        """The LatentCache of rows whose pages are ``table`` [B, n] (int32, -1: none) shifted by ``shifts`` [B]."""
        return LatentCache.paged(self.kv, self.pe, table, shifts, BLANK)
