"""The decoding engine: expanded prefill, absorbed decode over one preallocated latent cache, batches of
prompts of different lengths, and MTP speculative decoding.

Cache layout. A batch shares one slot counter ``cur``: every step writes its chunk at slots
[cur, cur + T) for all rows. Positions (for RoPE) are kept per row, separately from slots, and a
bool ``valid[B, S]`` says which slots hold a row's real tokens. Left padding, a rejected draft in one
row while another row accepted, and rows shifted when two batches merge all become invalid slots
("holes") that the attention mask hides. With one row there are never holes: a rejected draft's slot is
simply overwritten by the next step (the cache is positional), and no mask is built at all.

Speculation (MTP depth 1, as DeepSeek-V3 ships). The MTP layer at position i reads the main model's
final hidden state at i and the embedding of token i + 1 and predicts token i + 2. Each step feeds
[last token, draft] to the main model in one forward, verifies the draft by rejection sampling, then
runs the MTP layer over the newly committed positions (its own cache layer, same slots) to draft the
next token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv3.errors import DSV3Error
from dsv3.infer.detok import TextStream
from dsv3.infer.sampling import GREEDY, SamplingParams, draw, probabilities
from dsv3.infer.speculative import verify
from dsv3.model.mla import LatentCache
from dsv3.model.transformer import Transformer


@dataclass
class Request:
    """One generation request. ``cancelled`` may be set from another thread; the row is then dropped."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    cancelled: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise DSV3Error("the prompt is empty: give at least one token")
        if self.max_new_tokens < 1:
            raise DSV3Error(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Event:
    """What one step produced for one request: new token ids, the text they release, and whether the
    request is finished ("stop", "length" or "cancelled")."""

    request: Request
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class Stats:
    """Counters over the decode steps (prefill excluded)."""

    main_forwards: int = 0  # decode forwards of the main model
    row_steps: int = 0  # rows x decode forwards
    tokens: int = 0  # tokens emitted by decode steps
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache_bytes: int = 0  # largest latent-cache allocation
    cache_bytes_per_token_per_layer: float = 0.0  # its bytes / (layers x rows x slots)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Tokens each row gains per main-model forward (1 without speculation)."""
        return self.tokens / self.row_steps if self.row_steps else None


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str


class Row:
    """Decoding state of one request inside a batch."""

    def __init__(self, request: Request, tokenizer, eos_ids: frozenset[int]):
        self.request = request
        self.params = request.sampling
        self.gen = request.sampling.generator()
        self.stop_ids = request.stop_token_ids | eos_ids
        self.stream = TextStream(tokenizer, request.stop_strings)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.last = 0  # newest token: sampled, not yet in the cache
        self.next_pos = len(request.prompt_ids)  # its position
        self.draft: int | None = None
        self.draft_q: torch.Tensor | None = None  # [V] distribution the draft was drawn from

    def commit(self, tokens: list[int]) -> Event:
        """Take new tokens in order until a stop condition; returns what to tell the client."""
        kept, text, hit = [], [], False
        for tok in tokens:
            kept.append(tok)
            self.generated.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            delta, hit = self.stream.push(tok)
            text.append(delta)
            if hit:
                self.finish_reason = "stop"
                break
            if len(self.generated) >= self.request.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason and not hit:
            text.append(self.stream.flush())  # the held-back tail is final now
        self.last = tokens[-1]
        return Event(self.request, kept, "".join(text), self.finish_reason)


class Engine:
    """Generation over a :class:`Transformer`. ``speculative=True`` drafts with the first MTP layer."""

    def __init__(self, model: Transformer, tokenizer=None, speculative: bool = False,
                 cache_dtype: torch.dtype | None = None, eos_token_ids: frozenset[int] | None = None):
        if speculative and not model.mtp_layers:
            raise DSV3Error("--speculative mtp needs a checkpoint with an MTP layer (num_nextn_predict_layers >= 1)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.cache_dtype = cache_dtype or next(model.parameters()).dtype
        self.device = model.inv_freq.device  # inputs go where the weights are; sampling stays on the CPU
        self.eos_ids = eos_token_ids if eos_token_ids is not None else model.config.eos_token_ids

    def start(self, requests: list[Request]) -> Batch:
        """Prefill ``requests`` as one batch; the first token of each is in ``batch.first_events``."""
        return Batch(self, requests)

    def stream(self, requests: list[Request]) -> Iterator[Event]:
        """Events as tokens are produced, for all requests decoded together."""
        batch = self.start(requests)
        yield from batch.first_events
        while batch.rows:
            yield from batch.step()
        self.last_stats = batch.stats

    def generate(self, requests: list[Request]) -> list[Result]:
        parts: dict[int, tuple[list[int], list[str], list[str]]] = {id(r): ([], [], []) for r in requests}
        for ev in self.stream(requests):
            ids, text, reason = parts[id(ev.request)]
            ids += ev.token_ids
            text.append(ev.text)
            if ev.finish_reason:
                reason.append(ev.finish_reason)
        return [Result(parts[id(r)][0], "".join(parts[id(r)][1]), parts[id(r)][2][0]) for r in requests]


class Batch:
    """Rows decoded together over one latent cache; see the module docstring for the layout."""

    def __init__(self, engine: Engine, requests: list[Request]):
        self.engine, self.model, self.device = engine, engine.model, engine.device
        self.stats = Stats()
        self.rows = [Row(r, engine.tokenizer, engine.eos_ids) for r in requests]
        self.T = 2 if engine.speculative else 1
        t0 = time.perf_counter()
        self.first_events = self._prefill()
        self.stats.prefill_s = time.perf_counter() - t0

    # ---- cache bookkeeping ---------------------------------------------------------------
    def _alloc(self, batch: int, slots: int) -> None:
        self.cache: LatentCache = self.model.new_cache(batch, slots, dtype=self.engine.cache_dtype)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool)
        self._record_cache()

    def _capacity_for(self, cur: int) -> int:
        """Slots needed from ``cur`` so that every row can finish (holes may cost a slot per step)."""
        remaining = max((r.request.max_new_tokens - len(r.generated) for r in self.rows), default=0)
        per_step = 1 if len(self.rows) == 1 else self.T
        return cur + per_step * remaining + self.T

    def _mask(self, start: int, T: int) -> torch.Tensor | None:
        """bool [B, T, start + T]: a query sees valid keys and always itself (no empty softmax)."""
        if not self.holes:
            return None
        S = start + T
        keys = self.valid[:, None, :S]
        self_slot = torch.arange(S)[None, :] == torch.arange(start, S)[:, None]  # [T, S]
        return (keys | self_slot[None]).to(self.device)

    def _reshape(self, keep: list[int], shift: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``keep`` of the cache moved ``shift`` slots right into ``slots`` slots: (kv, pe, valid)."""
        n, cur = len(keep), self.cur
        idx = torch.tensor(keep, dtype=torch.long)
        kv = self.cache.kv.new_zeros(self.cache.kv.shape[0], n, slots, self.cache.kv.shape[-1])
        pe = self.cache.pe.new_zeros(self.cache.pe.shape[0], n, slots, self.cache.pe.shape[-1])
        valid = torch.zeros(n, slots, dtype=torch.bool)
        on_device = idx.to(self.device)
        kv[:, :, shift : shift + cur] = self.cache.kv[:, on_device, :cur]
        pe[:, :, shift : shift + cur] = self.cache.pe[:, on_device, :cur]
        valid[:, shift : shift + cur] = self.valid[idx, :cur]
        return kv, pe, valid

    def _set(self, kv: torch.Tensor, pe: torch.Tensor, valid: torch.Tensor, cur: int) -> None:
        self.cache = self.model.new_cache(kv.shape[1], 0, dtype=self.engine.cache_dtype)
        self.cache.kv, self.cache.pe, self.valid, self.cur = kv, pe, valid, cur
        self.holes = bool((~valid[:, :cur]).any())
        self._record_cache()

    def _record_cache(self) -> None:
        layers, rows, slots = self.cache.kv.shape[:3]
        if self.cache.nbytes > self.stats.cache_bytes and rows * slots:
            self.stats.cache_bytes = self.cache.nbytes
            self.stats.cache_bytes_per_token_per_layer = self.cache.nbytes / (layers * rows * slots)

    def _ensure_capacity(self) -> None:
        if self.cur + self.T > self.cache.max_len:
            self._set(*self._reshape(list(range(len(self.rows))), 0, self._capacity_for(self.cur)), self.cur)

    def drop(self, finished: list[int]) -> None:
        """Remove rows (finished or cancelled) so that they cost nothing from the next step on."""
        if not finished:
            return
        keep = [b for b in range(len(self.rows)) if b not in set(finished)]
        if keep:
            self._set(*self._reshape(keep, 0, self.cache.max_len), self.cur)
        self.rows = [self.rows[b] for b in keep]

    def merge(self, other: Batch) -> None:
        """Continuous batching: take ``other``'s rows into this batch. The shorter history is shifted
        right so both end at the same slot; positions are per row, so nothing is recomputed."""
        cur = max(self.cur, other.cur)
        mine, theirs = list(range(len(self.rows))), list(range(len(other.rows)))
        self.rows = self.rows + other.rows
        slots = max(self._capacity_for(cur), self.cache.max_len + cur - self.cur,
                    other.cache.max_len + cur - other.cur)
        a = self._reshape(mine, cur - self.cur, slots)
        b = other._reshape(theirs, cur - other.cur, slots)
        self._set(torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1), torch.cat([a[2], b[2]], 0), cur)
        self.stats.prefill_s += other.stats.prefill_s
        self.stats.cache_bytes = max(self.stats.cache_bytes, other.stats.cache_bytes)

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self) -> list[Event]:
        prompts = [r.request.prompt_ids for r in self.rows]
        B, L = len(prompts), max(len(p) for p in prompts)
        pads = torch.tensor([L - len(p) for p in prompts])
        ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts])  # [B, L] left-padded
        self.cur = 0
        self._alloc(B, self._capacity_for(L))
        self.valid[:, :L] = torch.arange(L)[None, :] >= pads[:, None]
        self.holes = bool(pads.any())
        positions = (torch.arange(L)[None, :] - pads[:, None]).clamp(min=0)  # [B, L]
        mask = self._mask(0, L)
        h = self.model.hidden_states(ids.to(self.device), positions=positions.to(self.device), cache=self.cache,
                                     start_pos=0, mask=mask)
        logits = self.model.lm_head(h[:, -1]).cpu()  # [B, V]
        events = [row.commit([draw(probabilities(logits[b], row.params), row.gen)])
                  for b, row in enumerate(self.rows)]
        self.cur = L
        if self.engine.speculative:
            nxt = torch.cat([ids[:, 1:], torch.tensor([[r.last] for r in self.rows])], dim=1)
            self._draft(h, nxt.to(self.device), positions.to(self.device), 0, [L] * B)
        self.drop([b for b, r in enumerate(self.rows) if r.finish_reason])
        return events

    # ---- decode ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One forward of the main model for every row (plus one MTP forward when speculating)."""
        t0 = time.perf_counter()
        events = self._cancel()
        if not self.rows:
            return events
        self._ensure_capacity()
        B, T, start = len(self.rows), self.T, self.cur
        ids = torch.tensor([[r.last] + ([r.draft] if T == 2 else []) for r in self.rows], device=self.device)
        positions = torch.tensor([r.next_pos for r in self.rows], device=self.device)[:, None] + torch.arange(
            T, device=self.device
        )  # [B, T]
        self.valid[:, start : start + T] = True
        h = self.model.hidden_states(ids, positions=positions, cache=self.cache, start_pos=start,
                                     mask=self._mask(start, T))
        logits = self.model.lm_head(h).cpu()  # [B, T, V]
        counts, committed = [], []
        for b, row in enumerate(self.rows):
            p = probabilities(logits[b], row.params)  # [T, V]
            if T == 2:
                new, accepted = verify(p, row.draft_q[None], [row.draft], row.gen)
                self.stats.drafted += 1
                self.stats.accepted += accepted
            else:
                new = [draw(p[0], row.gen)]
            counts.append(len(new))
            committed.append(new)
            events.append(row.commit(new))
            row.next_pos += len(new)
            self.stats.tokens += len(new)
        advance = max(counts)
        for b, n in enumerate(counts):
            if n < advance:
                self.valid[b, start + n : start + T] = False
                self.holes = True
        self.cur = start + advance
        self.stats.main_forwards += 1
        self.stats.row_steps += B
        if T == 2:
            nxt = torch.tensor([new + [0] * (advance - len(new)) for new in committed], device=self.device)
            self._draft(h[:, :advance], nxt, positions[:, :advance], start, counts)
        self.drop([b for b, r in enumerate(self.rows) if r.finish_reason])
        self.stats.decode_s += time.perf_counter() - t0
        return events

    def _draft(self, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, start: int,
               counts: list[int]) -> None:
        """MTP over the newly committed slots [start, start + n): h [B, n, D] with next_ids [B, n]
        (the token after each); each row drafts from its last committed slot."""
        n = next_ids.shape[1]
        h_mtp = self.model.mtp_hidden(0, h, next_ids, positions, cache=self.cache, start_pos=start,
                                      mask=self._mask(start, n))
        last = torch.tensor(counts) - 1
        logits = self.model.mtp_logits(0, h_mtp[torch.arange(len(counts)), last]).cpu()  # [B, V]
        for b, row in enumerate(self.rows):
            row.draft_q = probabilities(logits[b], row.params)
            row.draft = draw(row.draft_q, row.gen)

    def _cancel(self) -> list[Event]:
        gone = [b for b, r in enumerate(self.rows) if r.request.cancelled]
        events = []
        for b in gone:
            self.rows[b].finish_reason = "cancelled"
            events.append(Event(self.rows[b].request, [], "", "cancelled"))
        self.drop(gone)
        return events
