"""Chunked prefill: a long prompt prefilled a chunk at a time, along or between the running batch's decode steps.

A prompt's prefill is one forward over all its tokens; on a CPU a 4,000-token prompt takes most of a
second, and every stream that is decoding meanwhile gets no token. The server's scheduler therefore
prefills at most ``max_prefill_tokens`` prompt tokens whole between two decode steps (the
``--max-prefill-tokens`` option of ``dsv3 serve``): short prompts are prefilled together as before (a
whole prefill is the cheapest per token), and a longer one is cut into chunks of at most
``MAX_CHUNK_TOKENS``, sized by time (below).

A chunk is the prompt's tokens [s, e) run at positions s.. with the cache already holding slots [0, s),
so it attends to every earlier chunk: the same computation as one prefill, in pieces. It runs on the
absorbed path of the engine's decode step (``engine.decoder``, ``absorb=True``): on a CPU, FastDecode's
kernels, which take up to 64 tokens in one call (``dsv3.kernels.decode``) where the model's modules spend
about 20 ms a forward in fixed costs alone; the numbers may differ from a whole prefill's in the last bits,
as a cached prefix's do. The last chunk is prefilled by the batch the request joins
(``Batch._prefill_from``), which samples its first token; with MTP speculation each chunk also runs the MTP
layer over its slots, whose next tokens are the prompt's own (the last chunk's last one is the first
sampled token, as in a whole prefill). With a prefix cache, a prompt's cached blocks' pages are mapped first
and only the rest is chunked; the finished prompt's blocks are cached as a whole prefill's are.

A chunk can also ride along a decode step of the running batch (``rider``, ``Batch.step``): each of its
tokens becomes one more row of that step's forward, over the prompt's pages, so the step's weights are read
once for the batch and the chunk. A chunk run by itself reads them again, which on a 2-core CPU costs about
as much as a few tokens' arithmetic: with the chunks riding, a 4,000-token prompt among 4 streams reached
its first token in about 7 s rather than 16 s (``benchmarks/chunked_prefill.py``, docs/inference.md).

A chunk's cost grows with its tokens and with the slots they attend to, so a fixed size that suits the
start of a long prompt stalls the streams several times longer at its end. A chunk run by itself is sized
from a time budget (the scheduler gives the running batch's decode step time) at the last chunk's measured
cost per token; a rider is sized by the prompt's ``RiderPace`` (``infer/rider_pace.py``) from the steps'
measured times. Either way at most ``chunk_tokens``.
"""

from __future__ import annotations

import time

import torch

from dsv3.errors import DSV3Error
from dsv3.infer.engine import Batch, Engine, Event, Request, Rider
from dsv3.infer.prefix_cache import CachingBatch
from dsv3.infer.rider_pace import RiderPace
from dsv3.kernels.decode import FastDecode
from dsv3.kernels.decode_kernels import MAX_KERNEL_ROWS
from dsv3.kernels.graph_decode import GraphDecode
from dsv3.model.mla import LatentCache
from dsv3.model.transformer import Transformer

MAX_CHUNK_TOKENS = MAX_KERNEL_ROWS  # the most tokens the decode kernels take in one call


class ChunkedPrefill:
    """One request's prompt being prefilled a chunk at a time (at most ``chunk_tokens`` tokens); ``advance``
    runs the next chunk and, after the last, returns the batch that holds the request (its first token in
    ``first_events``)."""

    def __init__(self, engine: Engine, request: Request, chunk_tokens: int):
        if chunk_tokens < 1:
            raise DSV3Error(f"a prefill chunk must hold >= 1 token, got {chunk_tokens}")
        self.engine, self.request, self.chunk_tokens = engine, request, chunk_tokens
        self.pages: list[int] = []  # the prompt's pages of the engine's pool, so far
        self.seconds_per_token: float | None = None  # the last chunk's measured cost
        self.pace: RiderPace | None = None  # the riders' sizes, from the first ride on
        self.done = self._map_cached_prefix()

    @property
    def remaining(self) -> int:
        """Prompt tokens not prefilled yet."""
        return len(self.request.prompt_ids) - self.done

    @property
    def cache(self) -> LatentCache:
        """The prompt's cache: one row over its pages."""
        return self.engine.pool.cache([self.pages], [0])

    def reserve(self, end: int) -> None:
        """Pages for slots [0, end) (PoolFull, nothing taken, when the pool lacks them)."""
        need = self.engine.pool.pages_for(end) - len(self.pages)
        if need > 0:
            self.pages += self.engine.pool.take(need)

    def release(self) -> None:
        """Give the pages back (the request was cancelled or failed)."""
        self.engine.pool.release(self.pages)
        self.pages = []

    def _map_cached_prefix(self) -> int:
        """Map the prompt's cached blocks (if any) at the head of its pages; returns the first slot left to
        prefill (with MTP, the slot before the prefix's end, whose MTP entry is the request's own)."""
        cache = self.engine.prefix_cache
        if cache is None:
            return 0
        self.pages = cache.lease(self.request.prompt_ids)
        n = len(self.pages) * cache.block_tokens
        self.request.cached_tokens = n
        return n - 1 if n and self.engine.speculative else n

    def next_tokens(self, seconds: float | None = None, first: int = 1) -> int:
        """The next chunk's size: ``chunk_tokens``; with a budget of ``seconds``, as many tokens as fit in it
        at the last chunk's cost per token (``first`` before any chunk has run), from 1 to ``chunk_tokens``."""
        if seconds is None:
            return self.chunk_tokens
        if self.seconds_per_token is None:
            return max(1, min(first, self.chunk_tokens))
        return max(1, min(int(seconds / self.seconds_per_token), self.chunk_tokens))

    @torch.inference_mode()
    def advance(self, seconds: float | None = None, first: int = 1) -> Batch | None:
        """Prefill the next chunk (sized by ``next_tokens``); the request's batch once the prompt is all in,
        else None."""
        n = self.next_tokens(seconds, first)
        if self.remaining <= n:
            pages, self.pages = self.pages, []  # the batch owns them now
            return PrefilledBatch(self.engine, self.request, pages, self.done)
        self.reserve(self.done + n)
        t0 = time.perf_counter()
        self._chunk(self.done, self.done + n, self.engine.decoder, absorb=True)
        self.seconds_per_token = (time.perf_counter() - t0) / n
        self.done += n
        return None

    def rider(self, n: int) -> Rider | None:
        """The next ``n`` prompt tokens as a rider of the running batch's next decode step, their pages
        reserved (PoolFull, nothing taken, when the pool lacks them); None when they would end the prompt:
        its last chunk is prefilled by the batch it joins, which samples its first token (``advance``)."""
        if self.remaining <= n:
            return None
        self.reserve(self.done + n)
        return Rider(self.pages, self.done, list(self.request.prompt_ids[self.done : self.done + n]))

    def rider_tokens(self, plain_step_s: float, rows: int) -> int:
        """The next rider's tokens beside ``rows`` rows; ``plain_step_s``: their plain step, which the first
        ride takes as the pace to hold. At most ``chunk_tokens`` and what one kernel call takes with the rows."""
        if self.pace is None:
            self.pace = RiderPace(plain_step_s)
        return self.pace.tokens(rows, min(self.chunk_tokens, MAX_CHUNK_TOKENS - rows))

    def rode(self, rider: Rider, seconds: float) -> None:
        """A rider's tokens are in the cache; ``seconds``: the step that carried them (the pace sizes the next
        rider from it)."""
        self.done = rider.end
        if self.pace is not None:
            self.pace.rode(len(rider.ids), seconds)

    @torch.inference_mode()
    def prefill_through_modules(self, end: int) -> None:
        """Slots [done, end) in one forward through the model's modules (a whole prefill's path, whose large
        matmuls a long stretch of prompt fills), into pages already reserved (``reserve``). It touches
        neither the pool nor the decode step, so it may run on another thread while the running batch
        decodes (``dsv3.infer.prefill_beside``)."""
        self._chunk(self.done, end, self.engine.model, absorb=None)
        self.done = end

    def _chunk(self, start: int, end: int, net: Transformer | FastDecode | GraphDecode, absorb: bool | None) -> None:
        """Slots [start, end) of the main layers (and of the MTP layer, whose next tokens the prompt holds),
        through ``net``: the decode step (``engine.decoder``, absorbed) or the model's modules."""
        device, prompt = self.engine.device, self.request.prompt_ids
        ids = torch.tensor([prompt[start:end]], device=device)
        positions = torch.arange(start, end, device=device)[None]
        h = net.hidden_states(ids, positions=positions, cache=self.cache, start_pos=start, absorb=absorb)
        if self.engine.speculative:
            nxt = torch.tensor([prompt[start + 1 : end + 1]], device=device)
            net.mtp_hidden(0, h, nxt, positions, cache=self.cache, start_pos=start, absorb=absorb)


def chunk_hidden(engine: Engine, ids: torch.Tensor, positions: torch.Tensor, cache: LatentCache,
                 start: int) -> torch.Tensor:
    """The main layers' hidden states [1, T, D] of a chunk, slots [start, start + T), on the decode step's
    absorbed path."""
    return engine.decoder.hidden_states(ids, positions=positions, cache=cache, start_pos=start, absorb=True)


class PrefilledBatch(CachingBatch):
    """The batch of one request whose cache already holds its prompt's slots [0, ``done``): it prefills the
    rest (the last chunk) and samples the first token; its blocks go to the prefix cache when there is one."""

    def __init__(self, engine: Engine, request: Request, pages: list[int], done: int):
        self._given, self._done = pages, done
        super().__init__(engine, [request])

    @torch.inference_mode()
    def _prefill(self) -> list[Event]:
        self.cur = 0
        self._alloc([0] * len(self.rows))
        if not self.rows:  # the request could not start (its error event is already out)
            self.engine.pool.release(self._given)
            return []
        self.pages = [self._given]
        self._map()
        self._reserve(len(self.rows[0].request.prompt_ids) + self.T)
        return self._prefill_from(self._done)

    def _hidden_from(self, ids: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        return chunk_hidden(self.engine, ids, positions, self.cache, start)

    def _prefilled(self) -> None:
        if self.engine.prefix_cache is not None:
            super()._prefilled()
