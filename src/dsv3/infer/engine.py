"""The decoding engine: expanded prefill, absorbed decode over a paged latent cache, batches of prompts
of different lengths, and MTP speculative decoding.

Cache layout. Every batch's latent cache lives in pages of one pool (``dsv3.infer.page_pool``): a row
holds a list of pages, taken as its context grows and given back when it ends. A batch shares one slot
counter ``cur``: every step writes its chunk at slots [cur, cur + T) for all rows. A row's slots are
shifted right by its own ``shift`` in its pages (``LatentCache.paged``), so that left padding and the
right-alignment of a merge cost no bytes: merging two batches concatenates their page tables, dropping a
row gives its pages back. Positions (for RoPE) are kept per row, separately from slots, and a bool
``valid[B, S]`` says which slots hold a row's real tokens. Left padding, a rejected draft in one row
while another row accepted, and rows shifted when two batches merge all become invalid slots ("holes")
that the attention mask hides. When a row leaves or joins, the slots before the first one any remaining
row holds are dropped (every row's shift and ``cur`` go down alike): under a steady stream of requests
the batch never empties, and without that its slot counter, and with it every step's attention span,
would grow by a slot a step for as long as the server runs. With one row there are never holes: a
rejected draft's slot is simply overwritten by the next step (the cache is positional), and no mask is
built at all. When the pool has no page for a step, the newest rows are preempted: they give their
pages back and are prefilled again (prompt and generated tokens) once there is room, with the tokens
and draws they would have had (``Batch.step``, ``Engine.resume``).

Speculation (MTP depth 1, as DeepSeek-V3 ships). The MTP layer at position i reads the main model's
final hidden state at i and the embedding of token i + 1 and predicts token i + 2. Each step feeds
[last token, draft] to the main model in one forward, verifies the draft by rejection sampling, then
runs the MTP layer over the newly committed positions (its own cache layer, same slots) to draft the
next token.

Failures belong to rows. A request that cannot start, or whose logits (or MTP draft logits) are not
finite, ends alone with finish_reason "error" and a message, rather than emitting a made-up token
(the argmax of NaN is 0) or raising for the whole batch. Rows attend only to their own slots, except
that a masked slot still multiplies its value by zero: a padded batch whose prefill comes out
non-finite is therefore prefilled again one request at a time (see ``Engine.start``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dsv3.data.chat_template import ChatTemplate
from dsv3.errors import DSV3Error
from dsv3.infer.detok import TextStream
from dsv3.infer.draft_vocab import DraftVocab
from dsv3.infer.logits_processors import LogitsProcessor, process
from dsv3.infer.page_pool import DEFAULT_PAGE_TOKENS, DEFAULT_POOL_BYTES, PagePool, PoolFull
from dsv3.infer.penalties import LogitsRules
from dsv3.infer.sampling import GREEDY, SamplingParams, all_finite, draw, greedy_tokens, probabilities
from dsv3.infer.speculative import verify
from dsv3.kernels.decode import FastDecode
from dsv3.kernels.decode_kernels import MAX_KERNEL_ROWS, before_next_call
from dsv3.kernels.graph_decode import GraphDecode, decode_step
from dsv3.model import huge_pages
from dsv3.model.mla import LatentCache
from dsv3.model.transformer import Transformer
from dsv3.parallel.overlap import run_interleaved


@dataclass
class Request:
    """One generation request. ``cancelled`` may be set from another thread; the row is then dropped.
    ``logprobs``: None for none; N >= 0 for the chosen token's log-probability and the N most likely.
    ``logits_processors``: this request's own changes to its logits (``dsv3.infer.logits_processors``).
    ``skip_special_tokens``: False keeps special tokens in the text (a tool call's markers, say)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    cancelled: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False  # only max_new_tokens, stop ids and stop strings end it (benchmarks)
    cached_tokens: int = 0  # prompt tokens the prefix cache served (set at prefill; see prefix_cache.py)
    logits_processors: tuple[LogitsProcessor, ...] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise DSV3Error("the prompt is empty: give at least one token")
        if self.max_new_tokens < 1:
            raise DSV3Error(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise DSV3Error(f"logprobs must be >= 0, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """log p(token) under the model's distribution (log-softmax of the logits, before temperature, top-k or
    top-p, as OpenAI reports it; after the request's penalties and biases, ``dsv3.infer.penalties``), and the
    ``top`` most likely (token, logprob) pairs. A token the request ruled out reads ``LOGPROB_FLOOR``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Event:
    """What one step produced for one request: new token ids, the text they release, and whether the
    request is finished ("stop", "length", "cancelled", or "error" with ``error`` saying why)."""

    request: Request
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass
class Rider:
    """Prompt tokens [start, start + len(ids)) of a long prompt being prefilled in chunks, run as extra rows
    of a decode step (``Batch.step``): the chunk's weights are then read once with the step's, not again by a
    forward of its own. ``pages`` holds the prompt's slots [0, end); ``ridden`` is set once the step ran them."""

    pages: list[int]
    start: int
    ids: list[int]
    ridden: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


class RowError(Exception):
    """A failure that belongs to one request (bad sampling state, non-finite logits): that row ends
    with finish_reason "error" and the others go on."""


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
    cache_bytes: int = 0  # most bytes of latent-cache pages the batch held at once
    cache_bytes_per_token_per_layer: float = 0.0  # a page's bytes / (layers x its slots)
    preemptions: int = 0  # rows preempted for want of pages

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
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


def finite_logits(logits: torch.Tensor, row: Row, what: str = "logits") -> torch.Tensor:
    """``logits`` unchanged, or RowError when any is NaN or infinite: sampling from them would emit a
    meaningless token (argmax of NaN is token 0) or crash the whole batch (multinomial)."""
    if not all_finite(logits):
        raise RowError(f"the model produced non-finite {what} (NaN or inf) at position {row.next_pos}; "
                       "the checkpoint or the compute dtype is broken for this input")
    return logits


# Prompts' tokens in all up to which a prefill runs on the decode step's kernels, in calls of at most
# MAX_KERNEL_ROWS tokens (``Batch._prompt_hidden``): past about 200 the model's modules are as cheap or cheaper
# (``benchmarks/prefill_chunk_cost.py``, its prompts table).
KERNEL_PREFILL_TOKENS = 2 * MAX_KERNEL_ROWS
LOGPROB_FLOOR = -9999.0  # for -inf (min_tokens holding back end-of-sequence): JSON has no infinity


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n >= len(tokens), V]: the log-probability of tokens[j] under row j, with the ``top`` best."""
    lp = logits[: len(tokens)].float().log_softmax(-1).clamp(min=LOGPROB_FLOOR)
    best = lp.topk(min(top, lp.shape[-1]), dim=-1) if top else None
    out = []
    for j, tok in enumerate(tokens):
        pairs = tuple(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True)) if best else ()
        out.append(TokenLogprob(tok, float(lp[j, tok]), pairs))
    return out


class Row:
    """Decoding state of one request inside a batch. ``vocab``: the model's vocabulary size (what the
    request's logits rules, when it asks for any, keep counts over)."""

    def __init__(self, request: Request, tokenizer, eos_ids: frozenset[int], vocab: int):
        self.request = request
        self.params = request.sampling
        self.gen = request.sampling.generator()
        self.stop_ids = request.stop_token_ids | (frozenset() if request.ignore_eos else eos_ids)
        self.rules = LogitsRules.for_row(self.params, request.prompt_ids, self.stop_ids, vocab)
        self.stream = TextStream(tokenizer, request.stop_strings, request.skip_special_tokens)
        self.processors = request.logits_processors
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.last = 0  # newest token: sampled, not yet in the cache
        self.next_pos = len(request.prompt_ids)  # its position
        self.draft: int | None = None
        self.draft_q: torch.Tensor | None = None  # [V] distribution the draft was drawn from (None when greedy)
        self.new: list[int] = []  # tokens the last step accepted (none when it failed)

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> Event:
        """Take new tokens in order until a stop condition; returns what to tell the client."""
        kept, text, hit = [], [], False
        for tok in tokens:
            kept.append(tok)
            self.generated.append(tok)
            if self.rules is not None:
                self.rules.observe(tok)
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
        return Event(self.request, kept, "".join(text), self.finish_reason,
                     logprobs=logprobs[: len(kept)] if logprobs is not None else None)

    def processed(self, logits: torch.Tensor, draft: int | None = None) -> torch.Tensor:
        """A copy of logits [T, V] (fp32) after the request's processors: row 0 follows the generated tokens,
        row 1 (T = 2, verifying ``draft``) the draft too. Row 1 is processed only when row 0 allows the draft;
        otherwise verification rejects the draft whatever row 1 holds, and it is left a copy of row 0."""
        out = logits.float().clone()
        out[0] = process(self.processors, self.generated, out[0])
        if out.shape[0] > 1:
            allowed = draft is not None and bool(torch.isfinite(out[0, draft]))
            out[1] = process(self.processors, self.generated + [draft], out[1]) if allowed else out[0]
        return out

    def resume(self, generated: list[int]) -> None:
        """Take ``generated`` as the tokens already produced (a row moved from another rank)."""
        self.generated = list(generated)
        for tok in self.generated if self.rules is not None else ():
            self.rules.observe(tok)

    def fail(self, message: str) -> Event:
        """End this request alone with an error (it leaves the batch at the next drop)."""
        self.finish_reason = "error"
        return Event(self.request, [], "", "error", error=message)


def held_tokens(row: Row) -> list[int]:
    """What a row's cache holds once prefilled: its prompt and what it generated before its newest token (a
    preempted row prefilled again holds the latter too)."""
    return list(row.request.prompt_ids) + row.generated[:-1]


def context_limit(model: Transformer) -> int | None:
    """The model's context in positions (``max_position_embeddings``), or None when the config does
    not give a usable one."""
    n = getattr(model.config, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class Engine:
    """Generation over a :class:`Transformer`. ``speculative=True`` drafts with the first MTP layer;
    ``draft_vocab`` (token ids, or a :class:`DraftVocab`) restricts its drafts to those tokens, so that its
    head reads only their rows (``dsv3.infer.draft_vocab``; outputs unchanged, acceptance may drop).
    ``fast=False`` runs decode steps through the model's modules instead of ``decode_step``'s (same results;
    the readable reference path). On a CPU the model's weights are moved onto huge pages first (in place,
    values unchanged; ``dsv3.model.huge_pages``): decode steps stream them, and read them faster there."""

    def __init__(self, model: Transformer, tokenizer=None, speculative: bool = False,
                 cache_dtype: torch.dtype | None = None, eos_token_ids: frozenset[int] | None = None,
                 fast: bool = True, draft_vocab: DraftVocab | torch.Tensor | list[int] | None = None,
                 chat_template: ChatTemplate | None = None, kv_cache_bytes: int = DEFAULT_POOL_BYTES,
                 page_tokens: int = DEFAULT_PAGE_TOKENS):
        if speculative and not model.mtp_layers:
            raise DSV3Error("--speculative mtp needs a checkpoint with an MTP layer (num_nextn_predict_layers >= 1)")
        if draft_vocab is not None and not speculative:
            raise DSV3Error("--draft-vocab restricts MTP drafts: it needs --speculative mtp")
        if draft_vocab is not None and not isinstance(draft_vocab, DraftVocab):
            draft_vocab = DraftVocab(draft_vocab, model.config.vocab_size)
        self.draft_vocab: DraftVocab | None = draft_vocab
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the checkpoint's; None: the tokenizer's default (infer.chat_template)
        self.speculative = speculative
        self.cache_dtype = cache_dtype or next(model.parameters()).dtype
        self.device = model.inv_freq.device  # inputs go where the weights are; sampling stays on the CPU
        self.eos_ids = eos_token_ids if eos_token_ids is not None else model.config.eos_token_ids
        self.context = context_limit(model)
        huge_pages.move_module(model)
        # every batch's latent cache: pages of one pool (``dsv3.infer.page_pool``)
        self.pool = PagePool(model, kv_cache_bytes, page_tokens, self.cache_dtype, self.device)
        self.prefix_cache = None  # a dsv3.infer.prefix_cache.PrefixCache: prompts reuse cached latent blocks
        self.max_prefill_tokens: int | None = None  # the server's prefill budget per decode step (chunked_prefill.py)
        self.prefill_threads = 0  # > 0: longer prompts prefilled on threads of their own (prefill_beside.py)
        self.kernel_prefill_tokens = KERNEL_PREFILL_TOKENS  # prompts' tokens up to which prefill runs on the kernels
        # decode steps only: FastDecode on a CPU, CUDA graphs on a GPU (dsv3.kernels.graph_decode), or the modules
        self.decoder: Transformer | FastDecode | GraphDecode = decode_step(model) if fast else model
        # Dual micro-batch decode: with 2, a decode step of two rows or more runs as two halves of its rows
        # whose forward generators ``drive`` interleaves (expert-parallel serving gives its lockstep's driver).
        self.micro_batches = 1
        self.drive: Callable[[list[Generator]], list] = run_interleaved

    def repage(self, page_tokens: int) -> None:
        """Make the pool's pages ``page_tokens`` long (a prefix cache's blocks are pages), before any is taken."""
        if page_tokens == self.pool.page_tokens:
            return
        if self.pool.free < self.pool.pages:
            raise DSV3Error("the latent cache's pages cannot change size while requests hold some")
        budget = (self.pool.pages + 1) * self.pool.page_bytes  # the blank page too
        self.pool = PagePool(self.model, budget, page_tokens, self.cache_dtype, self.device)

    def start(self, requests: list[Request]) -> Batch:
        """Prefill ``requests`` as one batch; the first token of each is in ``batch.first_events``.

        When a row's prefill comes out non-finite, the padding of the other rows may have been
        poisoned too (a masked slot holding NaN still gives 0 * NaN in attention), so each request is
        prefilled alone and the batches merged: only the row that is itself broken fails."""
        if self.prefix_cache is not None:
            return self.prefix_cache.start(self, requests)
        try:
            return Batch(self, requests)
        except _Poisoned:
            return self._merged([Batch(self, [r]) for r in requests])

    @staticmethod
    def _merged(batches: list[Batch]) -> Batch:
        events = [ev for b in batches for ev in b.first_events]
        live = [b for b in batches if b.rows] or batches[:1]
        for other in live[1:]:
            live[0].merge(other)
        live[0].first_events = events
        return live[0]

    def resume(self, rows: list[Row]) -> Batch:
        """The batch of rows preempted earlier (``Batch.step``), their caches prefilled again."""
        return Batch(self, [], rows)

    def resume_waiting(self, waiting: deque[Row], busy: Callable[[], bool]) -> Iterator[tuple[Row, Batch | Exception]]:
        """Prefill ``waiting``'s rows again, oldest first, each taken off it as it is tried: yields the row with
        its batch, or with the error it fails with (one that does not fit even with the pool to itself, or
        whose prefill failed: a row's failure is its own). When the pool is full while ``busy()`` (rows are
        running, and give pages back as they finish), it stops and the rest wait."""
        while waiting:
            row = waiting[0]
            try:
                fresh = self.resume([row])
            except PoolFull:
                if busy():
                    return
                waiting.popleft()
                yield row, PoolFull.alone(len(held_tokens(row)))
                continue
            except Exception as exc:
                waiting.popleft()
                yield row, exc
                continue
            waiting.popleft()
            yield row, fresh

    def stream(self, requests: list[Request]) -> Iterator[Event]:
        """Events as tokens are produced, for all requests decoded together. Rows preempted for want of cache
        pages are prefilled again, oldest first, as soon as the pool has pages for them, and join the running
        batch (as the server's scheduler resumes them); one that does not fit even alone fails."""
        batch = self.start(requests)
        yield from batch.first_events
        stats, waiting = batch.stats, deque()

        def running() -> bool:  # the batch as it is now: a resumed row's batch may take its place
            return bool(batch.rows)

        while batch.rows or waiting:
            if batch.rows:
                yield from batch.step()
            waiting += batch.take_preempted()
            for row, fresh in self.resume_waiting(waiting, running):
                if isinstance(fresh, Exception):
                    yield row.fail(str(fresh))
                elif batch.rows:
                    batch.merge(fresh)  # takes its prefill time into batch.stats
                else:
                    batch.release()
                    batch.stats.prefill_s += fresh.stats.prefill_s
                    fresh.stats, batch = batch.stats, fresh
        self.last_stats = stats

    def generate(self, requests: list[Request]) -> list[Result]:
        results = {id(r): Result([], "", "", logprobs=[] if r.logprobs is not None else None) for r in requests}
        for ev in self.stream(requests):
            res = results[id(ev.request)]
            res.token_ids += ev.token_ids
            res.text += ev.text
            if ev.logprobs is not None:
                res.logprobs += ev.logprobs
            if ev.finish_reason and not res.finish_reason:
                res.finish_reason, res.error = ev.finish_reason, ev.error
        return [results[id(r)] for r in requests]


def greedy_verify(logits: torch.Tensor, draft: int | None, best: list[int] | None = None) -> tuple[list[int], int]:
    """Greedy decoding of finite logits [T, V] (T = 2 when verifying ``draft``): (tokens, drafts accepted);
    ``best``: each row's argmax when already known.

    What ``verify`` gives for one-hot p and q, without building them: the draft is kept iff it is the
    argmax of the first row, then the second row's argmax follows; else the first row's argmax replaces
    it. Skipping the full-vocabulary one-hots, the residual and its multinomial saves about 1 ms a step."""
    best = greedy_tokens(logits) if best is None else best
    if draft is None:
        return best[:1], 0
    return ([draft, best[1]], 1) if draft == best[0] else (best[:1], 0)


def shared_prompts(prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
    """(the first row of each distinct prompt, in order; for every row, the index of its prompt in that
    list): rows asking for several samples of one prompt (``n``) share its prefill."""
    index: dict[tuple[int, ...], int] = {}
    firsts, owner = [], []
    for b, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(b)
        owner.append(index[key])
    return firsts, torch.tensor(owner, dtype=torch.long)


class _Poisoned(Exception):
    """A batched prefill came out non-finite with padding present: redo it one request at a time."""


class Batch:
    """Rows decoded together over one latent cache; see the module docstring for the layout."""

    def __init__(self, engine: Engine, requests: list[Request], resumed: list[Row] | None = None):
        """Prefill ``requests``; or, given ``resumed`` (rows preempted earlier, ``step``), prefill again what
        their caches held (prompt and generated tokens) and go on from their newest token."""
        self.engine, self.model, self.device = engine, engine.model, engine.device
        self.stats = Stats()
        self.T = 2 if engine.speculative else 1
        self.resumed = resumed is not None
        self.rows: list[Row] = list(resumed or [])
        self.pages: list[list[int]] = []
        failed = []
        for r in requests:
            try:
                self.rows.append(Row(r, engine.tokenizer, engine.eos_ids, engine.model.config.vocab_size))
            except Exception as exc:  # e.g. a seed torch cannot take: this request fails, not the batch
                failed.append(Event(r, [], "", "error", error=f"cannot start this request: {exc}"))
        t0 = time.perf_counter()
        try:
            self.first_events = failed + self._prefill()
        except BaseException:
            self.release()  # a prefill that fails (the pool full, say) keeps no page
            raise
        self._prefilled()
        self.drop([b for b, r in enumerate(self.rows) if r.finish_reason])
        self.stats.prefill_s = time.perf_counter() - t0

    def _prefilled(self) -> None:
        """Hook run once the prompts are in the cache, before finished rows leave (the prefix cache
        keeps their blocks here)."""

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, S]: which slots hold each row's own tokens (see the module docstring)."""
        return self._valid

    @valid.setter
    def valid(self, valid: torch.Tensor) -> None:
        self._valid, self._valid_np = valid, valid.numpy()  # a view: NumPy's slice costs less than torch's per step

    def _feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's ids and positions [B, T]: each row's newest token (and its draft) at its next positions,
        written through NumPy into one buffer kept from step to step (the decoder reads them during the step
        only), a few microseconds where building a tensor from lists takes tens."""
        B, T = len(self.rows), self.T
        if getattr(self, "_feed_np", None) is None or self._feed_np.shape[1:] != (B, T):
            self._feed_buffer = torch.empty(2, B, T, dtype=torch.long)
            self._feed_np = self._feed_buffer.numpy()
        feed = self._feed_np
        feed[0, :, 0] = [r.last for r in self.rows]
        feed[1, :, 0] = [r.next_pos for r in self.rows]
        if T == 2:
            feed[0, :, 1] = [r.draft for r in self.rows]
            feed[1, :, 1] = feed[1, :, 0] + 1
        ids, positions = self._feed_buffer.to(self.device)
        return ids, positions

    # ---- cache bookkeeping ---------------------------------------------------------------
    # Row b holds pages ``self.pages[b]`` of the engine's pool, its slots shifted right by ``self.shifts[b]``
    # (``LatentCache.paged``); ``self.cache`` is the page table over them, remade when pages change hands.
    def _alloc(self, shifts: list[int]) -> None:
        """Rows whose own slots start at ``shifts`` (their left padding), holding no page yet."""
        self.pages: list[list[int]] = [[] for _ in shifts]
        self.shifts = list(shifts)
        self.valid = torch.zeros(len(shifts), 0, dtype=torch.bool)
        self.holes = False
        self.preempted: list[Row] = []
        self._map()

    def _map(self) -> None:
        self.cache: LatentCache = self.engine.pool.cache(self.pages, self.shifts)
        held = len({page for pages in self.pages for page in pages}) * self.engine.pool.page_bytes
        if held > self.stats.cache_bytes:
            self.stats.cache_bytes = held
            self.stats.cache_bytes_per_token_per_layer = self.cache.bytes_per_token_per_layer()

    def _reserve(self, end: int) -> None:
        """Pages for every row's slots below ``end``, and ``valid`` that wide: PoolFull when the pool lacks
        them (the pages taken until then stay the rows')."""
        pool, taken = self.engine.pool, False
        try:
            for b, pages in enumerate(self.pages):
                need = pool.pages_for(end - self.shifts[b]) - len(pages)
                if need > 0:
                    pages += pool.take(need)
                    taken = True
        finally:
            if taken:
                self._map()
        if self.valid.shape[1] < end:  # grown by half again at least: a step does not copy it each time
            wider = torch.zeros(len(self.rows), max(end, self.valid.shape[1] * 3 // 2), dtype=torch.bool)
            wider[:, : self.valid.shape[1]] = self.valid
            self.valid = wider

    def _mask(self, start: int, T: int) -> torch.Tensor | None:
        """bool [B, T, start + T]: a query sees valid keys and always itself (no empty softmax)."""
        if not self.holes:
            return None
        S = start + T
        keys = self.valid[:, None, :S]
        self_slot = torch.arange(S)[None, :] == torch.arange(start, S)[:, None]  # [T, S]
        return (keys | self_slot[None]).to(self.device)

    def _first_live_slot(self) -> int:
        """The first slot below ``cur`` that any row holds a token in (``cur`` when none does): every slot
        before it is a hole of all rows, which ``_trim`` may drop."""
        live = self.valid[:, : self.cur].any(0)
        return int(live.int().argmax()) if bool(live.any()) else self.cur

    def _trim(self) -> None:
        """Drop the slots before the first one any row holds (every row's shift and ``cur`` go down alike;
        no byte moves): see the module docstring."""
        lead = self._first_live_slot() if self.rows else 0
        if lead:
            self.shifts = [s - lead for s in self.shifts]
            self.valid = self.valid[:, lead:].clone()
            self.cur -= lead
        self.holes = bool((~self.valid[:, : self.cur]).any())

    def _ensure_capacity(self) -> None:
        self._reserve(self.cur + self.T)

    def release(self) -> None:
        """Give every row's pages back to the pool (the batch is done with)."""
        for pages in self.pages:
            self.engine.pool.release(pages)
        self.pages = [[] for _ in self.pages]

    def drop(self, finished: list[int]) -> None:
        """Remove rows (finished or cancelled) so that they cost nothing from the next step on."""
        if not finished:
            return
        gone = set(finished)
        for b in gone:
            self.engine.pool.release(self.pages[b])
        keep = [b for b in range(len(self.rows)) if b not in gone]
        self.rows = [self.rows[b] for b in keep]
        self.pages, self.shifts = [self.pages[b] for b in keep], [self.shifts[b] for b in keep]
        self.valid = self.valid[keep]
        self._trim()
        self._map()

    def merge(self, other: Batch) -> None:
        """Continuous batching: take ``other``'s rows into this batch. Both histories are shifted so that they
        end at the same slot, the shorter one right, and slots that none of a batch's rows holds dropped from
        its left; positions are per row, so nothing is recomputed, and the pages stay where they are."""
        for batch in (self, other):
            batch._trim()
        cur = max(self.cur, other.cur)
        width = max(self.valid.shape[1] + cur - self.cur, other.valid.shape[1] + cur - other.cur)
        valid = torch.zeros(len(self.rows) + len(other.rows), width, dtype=torch.bool)
        for batch, rows in ((self, slice(0, len(self.rows))), (other, slice(len(self.rows), None))):
            d = cur - batch.cur
            valid[rows, d : d + batch.valid.shape[1]] = batch.valid
        self.shifts = [s + cur - self.cur for s in self.shifts] + [s + cur - other.cur for s in other.shifts]
        self.pages = self.pages + other.pages
        other.pages = []
        self.rows = self.rows + other.rows
        self.preempted += other.preempted
        self.valid, self.cur = valid, cur
        self.holes = bool((~valid[:, :cur]).any())
        self._map()
        self.stats.prefill_s += other.stats.prefill_s
        self.stats.cache_bytes = max(self.stats.cache_bytes, other.stats.cache_bytes)

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self) -> list[Event]:
        prompts = [held_tokens(r) for r in self.rows]
        B, L = len(prompts), max((len(p) for p in prompts), default=0)
        self.cur = 0
        pads = [L - len(p) for p in prompts]
        self._alloc(pads)
        if not B:
            return []
        self._reserve(L + self.T)
        pads = torch.tensor(pads)
        ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts])  # [B, L] left-padded
        self.valid[:, :L] = torch.arange(L)[None, :] >= pads[:, None]
        self.holes = bool(pads.any())
        positions = (torch.arange(L)[None, :] - pads[:, None]).clamp(min=0)  # [B, L]
        mask = self._mask(0, L)
        firsts, owner = shared_prompts(prompts)
        if len(firsts) < B:  # the same prompt on several rows (n choices): one forward, its pages shared
            h = self._prompt_hidden(ids[firsts].to(self.device), positions[firsts].to(self.device),
                                    self._select(firsts), 0, None if mask is None else mask[firsts])
            self._share_prompts(firsts, owner.tolist(), L)
            h = h[owner.to(self.device)]
        else:
            h = self._prompt_hidden(ids.to(self.device), positions.to(self.device), self.cache, 0, mask)
        self.cur = L
        if self.resumed:  # each row's newest token and draft are already chosen: only the caches are made again
            logits, events = None, []
        else:
            logits = self.model.lm_head(h[:, -1]).cpu()  # [B, V]
            self._check_poison(logits)
            events = [self._guarded(row, lambda row=row, b=b: self._sample(row, logits[b][None], False))
                      for b, row in enumerate(self.rows)]
        if self.engine.speculative:
            nxt = torch.cat([ids[:, 1:], torch.tensor([[r.last] for r in self.rows])], dim=1)
            events += self._draft(h, nxt.to(self.device), positions.to(self.device), 0, [L] * B)
        return events

    def _select(self, rows: list[int]) -> LatentCache:
        """The cache of some rows (their pages and shifts)."""
        return self.engine.pool.cache([self.pages[b] for b in rows], [self.shifts[b] for b in rows])

    def _share_prompts(self, firsts: list[int], owner: list[int], L: int) -> None:
        """Rows whose prompt another row (``firsts[owner[b]]``) was prefilled for: they share its pages that the
        prompt fills, and take copies of the rest (which each row goes on writing)."""
        pool = self.engine.pool
        for b, o in enumerate(owner):
            first = firsts[o]
            if b == first:
                continue
            full = min((L - self.shifts[b]) // pool.page_tokens, len(self.pages[first]))
            pool.release(self.pages[b][:full])
            pool.hold(self.pages[first][:full])
            pool.copy(self.pages[first][full:], self.pages[b][full:])
            self.pages[b][:full] = self.pages[first][:full]
        self._map()

    def _prefill_from(self, start: int) -> list[Event]:
        """Prefill slots [start, L) of prompts that all have L tokens, into a cache that already holds
        slots [0, start) (a cached prefix, or a long prompt's earlier chunks): no padding, positions
        continuing from ``start``. Returns each row's first token, and drafts the first MTP token."""
        prompts = [row.request.prompt_ids for row in self.rows]
        B, L = len(prompts), len(prompts[0])
        self.valid[:, :L] = True
        positions = torch.arange(start, L, device=self.device)[None].expand(B, -1)
        ids = torch.tensor([list(p[start:]) for p in prompts], device=self.device)
        h = self._hidden_from(ids, positions, start)
        logits = self.model.lm_head(h[:, -1]).cpu()  # [B, V]
        events = [self._guarded(row, lambda row=row, b=b: self._sample(row, logits[b][None], False))
                  for b, row in enumerate(self.rows)]
        self.cur = L
        if self.engine.speculative:
            nxt = torch.tensor([list(p[start + 1 :]) + [row.last] for p, row in zip(prompts, self.rows, strict=True)],
                               device=self.device)
            events += self._draft(h, nxt, positions, start, [L - start] * B)
        return events

    def _hidden_from(self, ids: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        """The hidden states [B, T, D] of ``_prefill_from``'s slots, as a prefill's (``_prompt_hidden``); a long
        prompt's last chunk runs as its other chunks do (``chunked_prefill``)."""
        return self._prompt_hidden(ids, positions, self.cache, start)

    def _prompt_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: LatentCache, start: int,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """The main layers' hidden states [B, L, D] of prompt tokens ids [B, L] at slots [start, start + L).
        Short prompts run on the CPU decode step's absorbed path, as a prompt's chunks do (exact over any
        cache, equal to the module path up to the last bits), ``MAX_KERNEL_ROWS`` tokens a call: rows in
        groups, up to ``engine.kernel_prefill_tokens`` tokens in all. A short prompt's forward through the
        model's modules is mostly their fixed costs per call (``prefill_chunk_cost.py`` times both paths, a
        chunk and prompts arriving together). Longer prompts, and every device but the CPU, run the model's
        modules, whose large matmuls a long prompt fills."""
        B, L = ids.shape
        if not (isinstance(self.engine.decoder, FastDecode) and L <= MAX_KERNEL_ROWS
                and B * L <= self.engine.kernel_prefill_tokens):
            return self.model.hidden_states(ids, positions=positions, cache=cache, start_pos=start, mask=mask)
        per = MAX_KERNEL_ROWS // L  # rows a call
        if positions.shape[0] != B:
            positions = positions.expand(B, -1)
        parts = [self.engine.decoder.hidden_states(ids[rows], positions=positions[rows],
                                                   cache=cache if per >= B else cache.select(rows), start_pos=start,
                                                   mask=None if mask is None else mask[rows], absorb=True)
                 for rows in (slice(r, r + per) for r in range(0, B, per))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _check_poison(self, logits: torch.Tensor) -> None:
        """Raise _Poisoned when some rows of a padded batch came out non-finite (see Engine.start)."""
        if self.holes and len(self.rows) > 1 and not bool(torch.isfinite(logits).all()):
            raise _Poisoned

    # ---- per-row sampling --------------------------------------------------------------------
    def _guarded(self, row: Row, work) -> Event:
        """``work()``'s event, or the row's own error event when it fails: one request's broken state
        or non-finite logits never end the others."""
        try:
            return work()
        except RowError as exc:
            return row.fail(str(exc))
        except Exception as exc:
            return row.fail(f"generation failed for this request: {exc}")

    def _scan(self, logits: torch.Tensor) -> list[int] | None:
        """Each row of logits [..., V]: its argmax, or -1 when it is not finite, from one C pass over the whole
        step (``FastDecode.scan_logits``: the step kernel's own, else ``decode_kernels.scan_logits``); None (each
        row checked and picked by itself) on the module path or when the kernels cannot read them. Saves two
        interpreter calls per row, slow after the weights have streamed through the caches."""
        decoder = self.engine.decoder
        return decoder.scan_logits(logits) if isinstance(decoder, FastDecode) else None

    def _sample(self, row: Row, logits: torch.Tensor, verifying: bool, best: list[int] | None = None) -> Event:
        """Pick and commit the row's next token(s) from its logits [T, V] (T = 2, ``verifying``: check its draft);
        ``best``: the step's scan of these logits (``_scan``), when it ran."""
        if best is None or -1 in best:
            finite_logits(logits, row)
        if row.rules is not None:  # penalties, biases, min_tokens: the distribution to sample and verify
            logits, best = row.rules.apply(logits, [row.draft] if verifying else []), None
        shown = logits  # what logprobs report: the rules applied, a grammar's mask not
        if row.processors:
            logits, best = row.processed(logits, row.draft if verifying else None), None
        if row.params.greedy:
            new, accepted = greedy_verify(logits, row.draft if verifying else None, best)
        elif verifying:  # each target row's distribution made only when verify reads it (none after a rejection)
            target = lambda i: probabilities(logits[i : i + 1], row.params)[0]  # noqa: E731
            new, accepted = verify(target, row.draft_q[None], [row.draft], row.gen)
        else:
            new, accepted = [draw(probabilities(logits[0], row.params), row.gen)], 0
        if verifying:
            self.stats.drafted += 1
            self.stats.accepted += accepted
        row.new = new
        n_top = row.request.logprobs
        return row.commit(new, token_logprobs(shown, new, n_top) if n_top is not None else None)

    # ---- decode ----------------------------------------------------------------------------
    @property
    def carries_riders(self) -> bool:
        """Whether ``step`` can run a prompt chunk's tokens as extra rows (``Rider``): one token a row (no
        speculation), one forward, on the CPU decode step."""
        return self.T == 1 and self.engine.micro_batches == 1 and isinstance(self.engine.decoder, FastDecode)

    @torch.inference_mode()
    def step(self, rider: Rider | None = None, before_forward: Callable[[], None] | None = None) -> list[Event]:
        """One forward of the main model for every row (plus one MTP forward when speculating); with a
        ``rider`` (``carries_riders`` only), that forward also writes its prompt tokens into their pages.
        ``before_forward`` is called once the step's rows are set: on the CPU decode step just before its
        kernels' call (``before_next_call``), elsewhere before the forward."""
        if rider is not None and not self.carries_riders:
            raise ValueError("this batch cannot carry a prompt chunk (speculation, micro-batches or not the CPU step)")
        t0 = time.perf_counter()
        events = self._cancel()
        events += self._make_room()
        if not self.rows:
            return events
        B, T, start = len(self.rows), self.T, self.cur
        ids, positions = self._feed()
        self._valid_np[:, start : start + T] = True
        with self._before_kernels(before_forward):
            if rider is None:
                h, logits = self._forward(ids, positions, start, self._mask(start, T))
            else:
                h, logits = self._forward_riding(ids, positions, start, rider)
        if not logits.is_cpu:
            logits = logits.cpu()  # [B, T, V]
        scan = self._scan(logits)
        committed = []
        for b, row in enumerate(self.rows):
            row.new = []
            best = None if scan is None else scan[b * T : (b + 1) * T]
            sample = lambda row=row, b=b, best=best: self._sample(row, logits[b], T == 2, best)  # noqa: E731
            events.append(self._guarded(row, sample))
            committed.append(row.new)
            row.next_pos += len(row.new)
        counts = [len(new) for new in committed]
        self.stats.tokens += sum(counts)
        advance = max(counts)
        for b, n in enumerate(counts):
            if n < advance or n == 0:
                self.valid[b, start + n : start + T] = False
                self.holes = True
        self.cur = start + advance
        self.stats.main_forwards += 1
        self.stats.row_steps += B
        if T == 2 and advance:
            nxt = torch.tensor([new + [0] * (advance - len(new)) for new in committed], device=self.device)
            events += self._draft(h[:, :advance], nxt, positions[:, :advance], start, counts)
        self.drop([b for b, r in enumerate(self.rows) if r.finish_reason])
        self.stats.decode_s += time.perf_counter() - t0
        return events

    def _before_kernels(self, fn: Callable[[], None] | None):
        """``fn`` run just before the CPU decode step's kernel call (after the forward, when that step falls
        back to the model's modules this once), or now on any other decoder."""
        if fn is not None and isinstance(self.engine.decoder, FastDecode):
            return before_next_call(fn)
        if fn is not None:
            fn()
        return nullcontext()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor | None):
        """The main model's hidden states [B, T, D] and logits [B, T, V] for a decode step: one forward, or
        (``micro_batches`` 2, two rows or more) two forwards over halves of the rows, each on its rows' view
        of the cache, driven together so that one half computes while the other's expert exchange is in
        flight."""
        engine, B = self.engine, ids.shape[0]
        if engine.micro_batches == 1 or B < 2:
            return engine.decoder.hidden_and_logits(ids, positions=positions, cache=self.cache, start_pos=start,
                                                    mask=mask)
        source = engine.decoder if hasattr(engine.decoder, "hidden_steps") else self.model
        halves = [slice(0, (B + 1) // 2), slice((B + 1) // 2, B)]
        steps = [source.hidden_steps(ids[s], positions[s], self._rows(s), start, None if mask is None else mask[s])
                 for s in halves]
        h = torch.cat(engine.drive(steps), dim=0)
        return h, engine.decoder.lm_head(h)

    def _forward_riding(self, ids: torch.Tensor, positions: torch.Tensor, start: int,
                        rider: Rider) -> tuple[torch.Tensor, torch.Tensor]:
        """``_forward`` of a one-token step with ``rider``'s n prompt tokens as n more rows, each over the
        prompt's pages and shifted so that its own slot is the step's slot: the kernels write every row's
        latent there, and a prompt token attends to the prompt up to itself, as in a prefill. The step's slot
        is the later of ``start`` and the prompt's last token's; the batch's rows are shifted right to it for
        this step only, their left padding masked (the kernels skip a leading masked span). Hidden states and
        logits [B, 1, .] of the batch's rows."""
        B, n = ids.shape[0], len(rider.ids)
        top = max(start, rider.end - 1)
        own = torch.arange(rider.start, rider.end)
        table, width = self.cache.table, max(self.cache.table.shape[1], len(rider.pages))
        rows = torch.full((B + n, width), -1, dtype=torch.int32)
        rows[:B, : table.shape[1]] = table
        rows[B:, : len(rider.pages)] = torch.tensor(rider.pages, dtype=torch.int32)
        shifts = torch.cat([self.cache.shift + (top - start), top - own])
        cache = self.engine.pool.rows(rows, shifts)
        keep = torch.zeros(B + n, 1, top + 1, dtype=torch.bool)
        keep[:B, 0, top - start :] = self.valid[:, : start + 1]
        keep[B:, 0] = torch.arange(top + 1)[None, :] >= (top - own)[:, None]
        all_ids = torch.cat([ids, torch.tensor(rider.ids, device=self.device)[:, None]])
        all_positions = torch.cat([positions, own.to(self.device)[:, None]])
        h = self.engine.decoder.hidden_states(all_ids, positions=all_positions, cache=cache, start_pos=top,
                                              mask=keep.to(self.device), absorb=True)[:B]
        rider.ridden = True
        return h, self.engine.decoder.lm_head(h)

    def _rows(self, rows: slice) -> LatentCache:
        """A view of the cache holding only ``rows``: what a micro-batch writes lands in the batch's cache."""
        return self.cache.select(rows)

    def _make_room(self) -> list[Event]:
        """Pages for this step's slots. When the pool has too few, the newest rows are preempted (their pages
        given back, the rows kept in ``preempted`` to be resumed when there is room, as vLLM's recompute
        preemption does) until the rest fit; a row that does not fit alone fails. Returns its error event."""
        while True:
            try:
                self._ensure_capacity()
                return []
            except PoolFull:
                if len(self.rows) == 1:
                    event = self.rows[0].fail(str(PoolFull.alone(len(held_tokens(self.rows[0])) + self.T)))
                    self.drop([0])
                    return [event]
                row = self.rows[-1]
                self.drop([len(self.rows) - 1])
                self.preempted.append(row)
                self.stats.preemptions += 1

    def take_preempted(self) -> list[Row]:
        rows, self.preempted = self.preempted, []
        return rows

    def _draft(self, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, start: int,
               counts: list[int]) -> list[Event]:
        """MTP over the newly committed slots [start, start + n): h [B, n, D] with next_ids [B, n]
        (the token after each); each row drafts from its last committed slot. Returns the error events
        of rows whose draft logits came out non-finite."""
        n = next_ids.shape[1]
        h_mtp = self.engine.decoder.mtp_hidden(0, h, next_ids, positions, cache=self.cache, start_pos=start,
                                               mask=self._mask(start, n))
        if self.resumed and start == 0:  # the rows keep the drafts they had: the same random draws follow
            return []
        h_last = self._last_committed(h_mtp, counts)
        vocab = self.engine.draft_vocab
        logits = (self.engine.decoder.mtp_logits(0, h_last) if vocab is None
                  else vocab.logits(self.engine.decoder, 0, h_last)).cpu()  # [B, V], or [B, K] over the draft vocab
        if start == 0:  # the prefill's draft: padding may have poisoned it too
            self._check_poison(logits)
        events, scan = [], self._scan(logits)
        for b, row in enumerate(self.rows):
            if not row.finish_reason:
                best = None if scan is None else scan[b]
                failed = self._guarded(row, lambda row=row, b=b, best=best: self._draw_draft(row, logits[b], best))
                events += [failed] if failed is not None else []
        return events

    @staticmethod
    def _last_committed(h_mtp: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each row's MTP state [B, D] at its last committed slot (a row that committed nothing: its first):
        a slice when every row committed as many (always at batch 1), else a gather."""
        last = [max(c, 1) - 1 for c in counts]
        if len(set(last)) == 1:
            return h_mtp[:, last[0]]
        return h_mtp[torch.arange(len(last), device=h_mtp.device), torch.tensor(last, device=h_mtp.device)]

    def _draw_draft(self, row: Row, logits: torch.Tensor, best: int | None = None) -> None:
        """The row's draft from the MTP logits [V] (or [K] over the draft vocabulary): the argmax when
        greedy (``greedy_verify`` needs no q), else a draw from q, kept as a distribution over [V];
        ``best``: the step's scan of these logits (``_scan``), when it ran."""
        if best is None or best < 0:
            finite_logits(logits, row, "MTP draft logits")
        vocab = self.engine.draft_vocab
        if row.processors and vocab is None:  # over a draft vocabulary only verification applies them
            logits, best = row.processed(logits[None])[0], None
        if row.params.greedy:
            j, row.draft_q = (greedy_tokens(logits)[0] if best is None else best), None
        else:
            q = probabilities(logits, row.params)
            j = draw(q, row.gen)
            row.draft_q = q if vocab is None else vocab.spread(q)
        row.draft = j if vocab is None else vocab.token(j)

    def _cancel(self) -> list[Event]:
        gone = [b for b, r in enumerate(self.rows) if r.request.cancelled]
        events = []
        for b in gone:
            self.rows[b].finish_reason = "cancelled"
            events.append(Event(self.rows[b].request, [], "", "cancelled"))
        self.drop(gone)
        return events


def merged(running: Batch | None, fresh: Batch) -> Batch | None:
    """The running batch after continuous batching takes in ``fresh`` at a step boundary (``fresh`` itself when
    nothing runs). When the merge raises, ``running`` is left as it was and only the newcomers fail: the
    caller reports them."""
    if not fresh.rows:
        return running
    if running is None or not running.rows:
        return fresh
    running.merge(fresh)
    return running
