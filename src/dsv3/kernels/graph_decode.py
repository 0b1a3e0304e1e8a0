"""The engine's decode step per device (``decode_step``): on the CPU ``FastDecode`` over the C kernels; on CUDA
``GraphDecode``, the static step (``StaticDecode``) compiled and captured as CUDA graphs for a ladder of batch
sizes, a batch running in the smallest graph that holds it.

Why: on a GPU a decode step of a small batch is bound by kernel launches, not by bytes (the module path issues
thousands per token, docs/gpu.md); replayed as one CUDA graph the step costs a few. A graph replays fixed
shapes at fixed addresses, and the engine's latent cache gives both: every batch's cache is a page table over
one pool allocated once per engine (``infer.page_pool``). Each rung of the ladder (1, 2, 4, 8, 16, 32 rows) is
a static step built over that pool itself (made again only for another pool or more slots than it has), and
each step copies the batch's page table and shifts into the rung's fixed-shape index buffers
(``StaticDecode.map``); the graph then reads and writes the pages in place, so a merge, a dropped row or a
row's new page costs nothing but that small copy, and the cache's contents are never copied. Rows past the
batch are padding, mapped to the blank page (their tokens are never read). Plain steps over a paged cache
only: the MTP verification step (two tokens a row), a batch over 32 rows, prefill and a plain cache run the
model's modules, as ``Engine(fast=False)`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv3.kernels.decode import FastDecode
from dsv3.kernels.static_decode import StaticDecode, unsupported
from dsv3.model.mla import LatentCache
from dsv3.model.transformer import Transformer

LADDER = (1, 2, 4, 8, 16, 32)
MIN_SLOTS = 256  # a rung's step attends over at least this many slots a row, then powers of two (each recaptures)


def decode_step(model: Transformer) -> FastDecode | GraphDecode:
    """The engine's decode step for the device the model is on: CUDA graphs on CUDA when the static step can
    run the model (``static_decode.unsupported``), else ``FastDecode``."""
    if model.inv_freq.device.type == "cuda" and unsupported(model) is None:
        return GraphDecode(model)
    return FastDecode(model)


class GraphDecode:
    """The decode-step interface of a :class:`Transformer` (``hidden_and_logits``, ``hidden_states``,
    ``lm_head``, ``mtp_hidden``, ``mtp_logits``), plain steps through the rung's compiled static step.
    ``mode`` is ``torch.compile``'s ("reduce-overhead" captures CUDA graphs); ``compile=False`` runs the
    static steps eagerly (the CPU tests)."""

    def __init__(self, model: Transformer, mode: str | None = "reduce-overhead", compile: bool = True):
        self.model, self.mode, self.compile = model, mode, compile
        self.rungs: dict[int, tuple[StaticDecode, Callable]] = {}

    def hidden_states(self, *args, **kwargs) -> torch.Tensor:
        return self.model.hidden_states(*args, **kwargs)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)

    def mtp_hidden(self, *args, **kwargs) -> torch.Tensor:
        return self.model.mtp_hidden(*args, **kwargs)

    def mtp_logits(self, depth: int, h_mtp: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_logits(depth, h_mtp)

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                          cache: LatentCache | None = None, start_pos: int = 0, mask: torch.Tensor | None = None,
                          absorb: bool | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``Transformer.hidden_and_logits`` for a decode step. A plain step (one token a row, at most 32 rows)
        over a paged cache (the engine's) runs in its rung's graph, reading and writing the pool in place, and
        returns no hidden states (None: only the MTP step, which runs the modules, reads them)."""
        B, T = input_ids.shape
        if (cache is None or cache.table is None or start_pos == 0 or T != 1 or B > LADDER[-1]
                or absorb is False):
            return self.model.hidden_and_logits(input_ids, positions=positions, cache=cache, start_pos=start_pos,
                                                mask=mask, absorb=absorb)
        if start_pos >= cache.max_len:  # what LatentCache.write says on the module path
            raise ValueError(f"cache overflow: writing up to position {start_pos + 1} in a cache of {cache.max_len}")
        rung = next(r for r in LADDER if r >= B)
        static, step = self._rung(rung, cache, start_pos + 1)
        static.map(cache)
        device, S = static.kv.device, static.max_len
        ids = torch.zeros(rung, 1, dtype=torch.long, device=device)
        ids[:B] = input_ids
        at = torch.zeros(rung, 1, dtype=torch.long, device=device)
        at[:B] = start_pos if positions is None else positions.expand(B, 1)
        valid = torch.ones(rung, S, dtype=torch.bool, device=device)  # padding rows see the blank page (finite)
        if mask is not None:
            valid[:B, : start_pos + 1] = mask[:, 0]
        return None, step(ids, at, torch.tensor(start_pos, device=device), valid)[:B, None]

    def _rung(self, rung: int, cache: LatentCache, slots: int) -> tuple[StaticDecode, Callable]:
        """The rung's static step over the pool of ``cache`` with at least ``slots`` slots a row (made, or made
        anew, here: the first time, for another pool, or for more slots)."""
        made = self.rungs.get(rung)
        if made is None or made[0].kv is not cache.kv or made[0].pe is not cache.pe or made[0].max_len < slots:
            size = max(MIN_SLOTS, 1 << (slots - 1).bit_length())
            static = StaticDecode(self.model, rung, size, pages=(cache.kv, cache.pe), blank=cache.blank)
            made = self.rungs[rung] = (static, static.compiled(self.mode) if self.compile else static)
        return made
