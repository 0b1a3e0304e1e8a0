"""Serving metrics in the Prometheus text exposition format (version 0.0.4), for ``GET /metrics``.

No client library: the format is small (``# HELP``/``# TYPE`` lines, counters ending in ``_total``,
histograms as cumulative ``_bucket{le=...}`` series with ``_sum`` and ``_count``), and the server must
not need one. The scheduler's worker thread records; the HTTP thread renders. Values are Python
numbers updated under the GIL, so a scrape sees each one whole.

Expert load: ``expert_load`` is a hook returning, per rank, every MoE layer's routed-token counts.
One process counts them where its MoE layers route (:class:`RouterCounts`); a multi-process server sets
the hook to gather its ranks' counts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch

# Seconds, as vLLM buckets its latencies; batch sizes in powers of two.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PREFIX = "dsv3"

ExpertLoad = Callable[[], dict[int, list[list[int]]]]  # rank -> [MoE layer][expert] routed tokens


def _number(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return repr(float(v)) if isinstance(v, float) and not v.is_integer() else str(int(v))


def _labels(pairs: dict[str, object]) -> str:
    if not pairs:
        return ""
    def esc(v: object) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}"


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


class ExpertCounts:
    """Routed tokens per expert of one MoE layer: a counter for ``MoE.routed_counters``. A call only keeps
    the chosen experts' index tensor (it runs in every decode step of every MoE layer, where each tensor
    operation costs interpreter time between the kernels); every ``FOLD`` calls, and on each read, the
    kept tensors are added into the counts in one bincount. The fast decode path's block kernel does not
    call it: it adds the experts it chooses into ``kernel_counts`` itself (``decode.kernel_tally``), so a
    counted layer keeps the whole-step kernel; a read sums both. The worker thread calls, the HTTP thread
    reads: folding holds a lock, appending needs none (a list append is atomic), and the kernel's adds are
    whole 64-bit words that a read sees before or after."""

    FOLD = 256

    def __init__(self, n_experts: int, device: torch.device):
        self.n_experts = n_experts
        self.counts = torch.zeros(n_experts, dtype=torch.long, device=device)
        self.pending: list[torch.Tensor] = []
        self.kernel_counts = torch.zeros(n_experts, dtype=torch.long)  # the C kernels' adds (CPU only)
        self.lock = threading.Lock()

    def __deepcopy__(self, memo) -> ExpertCounts:
        """The same counter: a copy of a counted model counts into it too (as a forward hook's copy did)."""
        return self

    def __call__(self, idx: torch.Tensor) -> None:
        self.pending.append(idx)
        if len(self.pending) >= self.FOLD:
            self.fold()

    def fold(self) -> None:
        with self.lock:
            n = len(self.pending)
            if not n:
                return
            chosen = torch.cat([i.reshape(-1).to(self.counts.device) for i in self.pending[:n]])
            del self.pending[:n]  # calls made meanwhile appended after the first n
            self.counts += torch.bincount(chosen, minlength=self.n_experts)[: self.n_experts]

    def tolist(self) -> list[int]:
        self.fold()
        return (self.counts.cpu() + self.kernel_counts).tolist()


class RouterCounts:
    """Routed tokens per (MoE layer, expert) in one process, counted wherever each layer routes: an
    :class:`ExpertCounts` in every layer's ``MoE.routed_counters``, which the module path (``MoE.route``)
    and the fast decode path's per-op calls (``decode.FeedForwardPlan``) call with the chosen experts, and
    whose ``kernel_counts`` its block kernels add to. Not a forward hook: a hooked layer would run every
    decode step through its modules, several times slower. Counts live on the router's device (no sync per
    step) and are made here, outside inference mode, so that any forward may add to them."""

    def __init__(self, model):
        self.layers = model.moe_layers()
        self.counts = [ExpertCounts(moe.n_experts, next(moe.gate.parameters(), torch.empty(0)).device)
                       for moe in self.layers]
        for moe, counts in zip(self.layers, self.counts, strict=True):
            moe.routed_counters.append(counts)

    def __call__(self) -> dict[int, list[list[int]]]:
        return {0: [c.tolist() for c in self.counts]}

    def remove(self) -> None:
        """Stop counting (the layers' other counters, if any, go on)."""
        for moe, counts in zip(self.layers, self.counts, strict=True):
            moe.routed_counters[:] = [c for c in moe.routed_counters if c is not counts]


class _Timing:
    __slots__ = ("arrived", "first", "last", "tokens")

    def __init__(self, arrived: float):
        self.arrived, self.first, self.last, self.tokens = arrived, None, None, 0


class ServingMetrics:
    """What the scheduler records about requests and steps, rendered for Prometheus by ``render``."""

    FINISH_REASONS = ("stop", "length", "cancelled", "error")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.requests = dict.fromkeys(self.FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.queue_time = Histogram(TTFT_BUCKETS)
        self.drafted = 0  # MTP: draft tokens verified, and how many of them were accepted
        self.accepted = 0
        self.preemptions = 0  # requests preempted for want of cache pages
        self.timings: dict[int, _Timing] = {}
        self.running: Callable[[], int] = lambda: 0
        self.waiting: Callable[[], int] = lambda: 0
        self.prefix_cache = None  # a PrefixCache when the engine has one (anything with its ``snapshot()``)
        self.expert_load: ExpertLoad | None = None

    # ---- recording (the worker thread) ----------------------------------------------------------
    def arrived(self, request) -> None:
        self.timings[id(request)] = _Timing(self.clock())

    def admitted(self, request) -> None:
        """The request leaves the queue for its prefill."""
        t = self.timings.get(id(request))
        if t is not None:
            self.queue_time.observe(self.clock() - t.arrived)

    def speculated(self, drafted: int, accepted: int) -> None:
        """A decode step verified ``drafted`` MTP draft tokens and accepted ``accepted`` of them."""
        self.drafted += drafted
        self.accepted += accepted

    def event(self, request, n_tokens: int, finish_reason: str | None) -> None:
        """A request's event: ``n_tokens`` new tokens, finished when ``finish_reason`` is set."""
        t = self.timings.get(id(request))
        if t is None:
            return
        now = self.clock()
        if n_tokens:
            if t.first is None:
                t.first = now
                self.ttft.observe(now - t.arrived)
            t.last = now
            t.tokens += n_tokens
        if finish_reason:
            self.finished(request, finish_reason)

    def finished(self, request, finish_reason: str) -> None:
        t = self.timings.pop(id(request), None)
        if t is None:
            return
        self.requests[finish_reason] = self.requests.get(finish_reason, 0) + 1
        self.prompt_tokens += len(request.prompt_ids)
        self.cached_prompt_tokens += getattr(request, "cached_tokens", 0)
        self.generation_tokens += t.tokens
        self.latency.observe(self.clock() - t.arrived)
        if t.tokens > 1:
            self.tpot.observe((t.last - t.first) / (t.tokens - 1))

    def step(self, batch_size: int) -> None:
        self.batch_size.observe(batch_size)

    def preempted(self, rows: int) -> None:
        """A decode step preempted ``rows`` requests for want of cache pages (they resume later)."""
        self.preemptions += rows

    # ---- rendering (the HTTP thread) ------------------------------------------------------------
    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, lines: list[str]) -> None:
            name += "_total" if kind == "counter" else ""  # as prometheus_client names a counter's family
            out.extend([f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"])
            out.extend(f"{PREFIX}_{line}" for line in lines)

        family("requests", "counter", "Finished requests by finish reason.",
               [f"requests_total{_labels({'finish_reason': r})} {n}" for r, n in self.requests.items()])
        family("prompt_tokens", "counter", "Prompt tokens of finished requests.",
               [f"prompt_tokens_total {self.prompt_tokens}"])
        family("prompt_cached_tokens", "counter", "Prompt tokens of finished requests served by the prefix cache.",
               [f"prompt_cached_tokens_total {self.cached_prompt_tokens}"])
        family("generation_tokens", "counter", "Tokens generated for finished requests.",
               [f"generation_tokens_total {self.generation_tokens}"])
        family("time_to_first_token_seconds", "histogram", "From arrival to the first generated token.",
               self.ttft.lines("time_to_first_token_seconds"))
        family("time_per_output_token_seconds", "histogram", "Mean time between tokens after the first, per request.",
               self.tpot.lines("time_per_output_token_seconds"))
        family("request_latency_seconds", "histogram", "From arrival to the last token.",
               self.latency.lines("request_latency_seconds"))
        family("batch_size", "histogram", "Requests in the batch at each decode step.",
               self.batch_size.lines("batch_size"))
        family("request_queue_time_seconds", "histogram", "From arrival to the start of the request's prefill.",
               self.queue_time.lines("request_queue_time_seconds"))
        family("spec_decode_draft_tokens", "counter", "MTP draft tokens verified by decode steps.",
               [f"spec_decode_draft_tokens_total {self.drafted}"])
        family("spec_decode_accepted_tokens", "counter",
               "MTP draft tokens accepted (acceptance rate: accepted / draft tokens).",
               [f"spec_decode_accepted_tokens_total {self.accepted}"])
        family("num_preemptions", "counter", "Requests preempted for want of latent cache pages (resumed later).",
               [f"num_preemptions_total {self.preemptions}"])
        family("requests_running", "gauge", "Requests being decoded.", [f"requests_running {self.running()}"])
        family("requests_waiting", "gauge", "Requests queued, not yet prefilled.",
               [f"requests_waiting {self.waiting()}"])
        if self.prefix_cache is not None:
            self._prefix_lines(family)
        if self.expert_load is not None:
            self._expert_lines(family)
        return "\n".join(out) + "\n"

    def _prefix_lines(self, family) -> None:
        cache = self.prefix_cache.snapshot()
        c = cache.counters
        gauges = [("blocks", "Blocks resident in the prefix cache.", cache.blocks),
                  ("bytes", "Bytes of the resident blocks.", cache.used_bytes),
                  ("capacity_bytes", "The prefix cache's byte budget.", cache.max_bytes),
                  ("block_tokens", "Tokens per block.", cache.block_tokens)]
        counters = [("queries", "Prompt tokens looked up in the prefix cache.", c.queries),
                    ("hits", "Prompt tokens served by the prefix cache (hit rate: hits / queries).", c.hits),
                    ("evictions", "Blocks evicted from memory.", c.evicted),
                    ("disk_reads", "Blocks read back from the on-disk tier.", c.disk_reads),
                    ("disk_writes", "Blocks written to the on-disk tier.", c.disk_writes),
                    ("disk_rejected", "On-disk block files ignored (corrupt or foreign).", c.disk_rejected)]
        for name, help_text, value in gauges:
            family(f"prefix_cache_{name}", "gauge", help_text, [f"prefix_cache_{name} {value}"])
        for name, help_text, value in counters:
            family(f"prefix_cache_{name}", "counter", help_text, [f"prefix_cache_{name}_total {value}"])

    def _expert_lines(self, family) -> None:
        loads = self.expert_load()
        per_expert, per_rank = [], []
        for rank, layers in sorted(loads.items()):
            total = 0
            for layer, counts in enumerate(layers):
                for expert, n in enumerate(counts):
                    per_expert.append(f"expert_tokens_total{_labels({'rank': rank, 'layer': layer, 'expert': expert})}"
                                      f" {int(n)}")
                    total += int(n)
            per_rank.append(f"rank_expert_tokens_total{_labels({'rank': rank})} {total}")
        family("expert_tokens", "counter", "Tokens routed to each expert (MoE layer in order) on each rank.",
               per_expert)
        family("rank_expert_tokens", "counter", "Tokens routed to the experts of each rank.", per_rank)
