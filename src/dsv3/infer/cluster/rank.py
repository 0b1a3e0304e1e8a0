"""One rank of a serving group: its own requests, continuous batching over its engine, one step at a time.

The front end (rank 0) sends every rank the same small control message per step (``Control``: new
requests by rank, cancellations, stop); each rank prefills the requests it was given, merges them into
its running batch, decodes one step, joins the other ranks' expert exchanges until all are done
(``Lockstep.finish``), and returns its events, which travel back to rank 0 as ``WireEvent``s. Requests are
named by an integer id (``rid``) on the wire: the front end keeps the HTTP side's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dsv3.errors import DSV3Error
from dsv3.infer.cluster.lockstep import Lockstep, LockstepBroken
from dsv3.infer.engine import Batch, Engine, Event, Request, TokenLogprob, merged
from dsv3.infer.grammar import Grammars
from dsv3.infer.prefix_cache import CacheSnapshot
from dsv3.infer.sampling import SamplingParams


@dataclass(frozen=True)
class WireRequest:
    """A request as the control message carries it (plain, picklable fields). A constrained request's
    logits processors (grammar matchers) cannot travel: their grammars' texts do, and the rank that decodes
    the request compiles its own (every rank has the tokenizer); a processor follows the tokens it is given,
    so one compiled on a decode rank for a row moved there takes up the generated tokens where they are."""

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    logprobs: int | None
    skip_special_tokens: bool = True  # False for tool calls, whose markers are special tokens
    ignore_eos: bool = False
    grammars: tuple[str, ...] = ()  # the texts of its grammar processors (``GrammarProcessor.grammar``), in order

    @classmethod
    def of(cls, rid: int, r: Request) -> WireRequest:
        return cls(rid, list(r.prompt_ids), r.max_new_tokens, r.sampling, r.stop_token_ids, r.stop_strings,
                   r.logprobs, r.skip_special_tokens, r.ignore_eos, tuple(_grammar_of(p) for p in r.logits_processors))

    def request(self, grammars: Grammars | None = None) -> Request:
        """This rank's copy of the request, its grammar processors compiled afresh by ``grammars``."""
        if self.grammars and grammars is None:
            raise DSV3Error("a constrained request needs the rank's grammar compiler")
        processors = tuple(grammars.recompile(g) for g in self.grammars) if self.grammars else ()
        return Request(self.prompt_ids, self.max_new_tokens, self.sampling, self.stop_token_ids,
                       self.stop_strings, logprobs=self.logprobs, skip_special_tokens=self.skip_special_tokens,
                       ignore_eos=self.ignore_eos, logits_processors=processors)


def _grammar_of(processor) -> str:
    """The text a logits processor's grammar was compiled from (the server makes no other processors)."""
    grammar = getattr(processor, "grammar", None)
    if not isinstance(grammar, str):
        raise DSV3Error(f"serve --ep cannot send a {type(processor).__name__} to its ranks (only grammars travel)")
    return grammar


@dataclass(frozen=True)
class WireEvent:
    """An engine event as it travels back to the front end."""

    rid: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens the rank's prefix cache served (known from the prefill on)

    def event(self, request: Request) -> Event:
        return Event(request, self.token_ids, self.text, self.finish_reason, self.error, self.logprobs)


@dataclass(frozen=True)
class Ready:
    """A prefilled request waiting on prefill rank ``rank`` for its move to a decode rank: ``slots`` cache
    slots (tokens) and a row state of ``state_bytes`` bytes."""

    rid: int
    rank: int
    slots: int
    state_bytes: int


@dataclass(frozen=True)
class Transfer:
    """Move request ``rid``'s latent cache and row state from prefill rank ``src`` to decode rank ``dst``."""

    rid: int
    src: int
    dst: int
    slots: int
    state_bytes: int


@dataclass
class Control:
    """What every rank does this step: ``new[rank]`` requests to start, rids to cancel, latent caches to
    move from prefill to decode ranks (before anything else), or stop."""

    new: dict[int, list[WireRequest]] = field(default_factory=dict)
    cancel: list[int] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    rebalance: bool = False  # EPLB: every group rebalances its experts before this step's work
    report_load: bool = False  # every rank adds its routed-token counts to its report (/metrics)
    stop: bool = False


@dataclass
class Report:
    """What one rank tells the front end after a step: its events, prefilled requests ready to move, and
    the latent-cache bytes and tokens it received this step."""

    events: list[WireEvent] = field(default_factory=list)
    ready: list[Ready] = field(default_factory=list)
    kv_bytes: int = 0
    kv_tokens: int = 0
    expert_load: list[list[int]] | None = None  # [MoE layer][expert] routed tokens so far, when asked
    prefix_cache: CacheSnapshot | None = None  # the rank's prefix cache, when it has one and was asked
    drafted: int = 0  # MTP draft tokens this step's decode verified, and how many of them it accepted
    accepted: int = 0


class RankWorker:
    """The requests of one rank and their running batch. ``step`` must be called by every rank of the
    group for every control message (the MoE exchanges inside it are collectives)."""

    def __init__(self, engine: Engine, lockstep: Lockstep, rank: int):
        self.engine, self.lockstep, self.rank = engine, lockstep, rank
        self.batch: Batch | None = None
        self.requests: dict[int, Request] = {}  # rid -> this rank's copy
        self.rids: dict[int, int] = {}  # id(request) -> rid
        self.drafted = self.accepted = 0  # MTP counts of the last decode step (they travel in its report)
        self.grammars = Grammars(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
        self.unusable: dict[int, str] = {}  # id(request) -> why its grammar did not compile here

    @property
    def active(self) -> int:
        return len(self.requests)

    def step(self, control: Control) -> Report:
        """Start this rank's new requests, decode one step of its batch, then join the other ranks' rounds."""
        self._rebalance(control)
        self._cancel(control.cancel)
        events = self._admit([self._register(w) for w in control.new.get(self.rank, [])])
        events += self._decode()
        self.lockstep.finish()
        return self._report(Report(self._wire(events)))

    def _report(self, report: Report) -> Report:
        """``report`` with this step's MTP counts (rank 0 adds them into /metrics, as one process does)."""
        report.drafted, report.accepted = self.drafted, self.accepted
        return report

    def _rebalance(self, control: Control) -> None:
        if control.rebalance:
            self.lockstep.rebalance()

    def _cancel(self, rids: list[int]) -> None:
        for rid in rids:
            if rid in self.requests:
                self.requests[rid].cancelled = True

    def _register(self, wire: WireRequest) -> Request:
        """This rank's copy of ``wire``. A grammar that does not compile here (rank 0 compiled it: only a rank
        unlike it gets there) fails its request alone, at its admission, rather than the step of the group."""
        try:
            request = wire.request(self.grammars)
        except DSV3Error as exc:
            request = replace(wire, grammars=()).request()
            self.unusable[id(request)] = f"generation failed on rank {self.rank}: {exc}"
        self.requests[wire.rid] = request
        self.rids[id(request)] = wire.rid
        return request

    def _admit(self, requests: list[Request]) -> list[Event]:
        """Prefill the new requests (cancelled and unusable ones end at once) and merge them into the running
        batch."""
        unusable = [r for r in requests if id(r) in self.unusable]
        requests = [r for r in requests if id(r) not in self.unusable]
        events = [self._unusable(r) for r in unusable]
        events += [Event(r, [], "", "cancelled") for r in requests if r.cancelled]
        live = [r for r in requests if not r.cancelled]
        for fresh in self._prefill(live) if live else []:
            events += self._join(fresh)
        return events

    def _unusable(self, request: Request) -> Event:
        return Event(request, [], "", "error", error=self.unusable.pop(id(request)))

    def _prefill(self, requests: list[Request]) -> list[Batch | Event]:
        """Prefilled together, or each alone when that fails, so that a request that breaks the prefill
        fails by itself; returns batches, and error events for requests that failed alone."""
        try:
            return [self.engine.start(requests)]
        except LockstepBroken:
            raise
        except Exception as exc:
            self._check_rounds(exc)
            if len(requests) == 1:
                return [Event(requests[0], [], "", "error", error=f"generation failed: {exc}")]
        return [b for r in requests for b in self._prefill([r])]

    def _join(self, fresh: Batch | Event) -> list[Event]:
        if isinstance(fresh, Event):
            return [fresh]
        try:
            self.batch = merged(self.batch, fresh)
        except Exception as exc:  # the running batch is left as it was: only the newcomers fail
            done = [ev for ev in fresh.first_events if ev.finish_reason]
            return done + [Event(r.request, [], "", "error", error=f"generation failed: {exc}") for r in fresh.rows]
        return list(fresh.first_events)

    def _decode(self) -> list[Event]:
        """One decode step of the running batch; its MTP draft and accepted tokens are kept for the report."""
        self.drafted = self.accepted = 0
        if self.batch is None or not self.batch.rows:
            return []
        stats = self.batch.stats
        drafted, accepted = stats.drafted, stats.accepted
        try:
            events = self.batch.step()
            self.drafted, self.accepted = stats.drafted - drafted, stats.accepted - accepted
            return events
        except LockstepBroken:
            raise
        except Exception as exc:  # a failing step fails its requests, not the server
            self._check_rounds(exc)
            rows, self.batch = self.batch.rows, None
            return [Event(r.request, [], "", "error", error=f"generation failed: {exc}") for r in rows]

    def _check_rounds(self, exc: Exception) -> None:
        """A failure in the middle of a round (a peer gone, most often) leaves the ranks' collectives
        unmatched: stop serving."""
        if self.lockstep.in_round:
            raise LockstepBroken(f"an expert exchange failed: {_first_line(exc)}") from exc

    def _wire(self, events: list[Event]) -> list[WireEvent]:
        out = []
        for ev in events:
            rid = self.rids[id(ev.request)]
            out.append(WireEvent(rid, ev.token_ids, ev.text, ev.finish_reason, ev.error, ev.logprobs,
                                 ev.request.cached_tokens))
            if ev.finish_reason and rid in self.requests:
                self.rids.pop(id(self.requests.pop(rid)), None)
        return out


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
