"""Pipeline bubbles measured on gloo processes, next to the DualPipe README's formulas.

Every rank times what its stages compute (forward, backward, backward-for-weights: the stage methods the
schedule calls) and the whole step; the measured bubble is 1 - (sum over ranks of compute time) / (P x
step wall time). F, B and W (forward, full backward, backward for weights of one stage and micro-batch)
are measured in one process on the same stages, and give the formulas' bubble: (PP-1)(F+B) for 1F1B and
(PP/2-1)(F&B+B-3W) for DualPipeV, whose PP counts stages (2 per rank) and whose F&B (a forward and a
backward overlapped) is F+B here, since nothing overlaps on a CPU. Peak activation memory per rank: the
bytes of the tensors autograd saves for backward (parameters excluded), counted by saved_tensors_hooks.

With ``ep`` > 1 (P x E processes) each stage's routed experts are split over its E replicas behind the
two-hop dispatcher. Under DualPipeV, steps that run the OVERLAP_F_B pairs in order alternate with steps that
run them concurrently (`run_concurrently`), every all-to-all is timed from launch to the end of its wait, and
the share of all-to-all time hidden is (pair time in order - pair time concurrent) / (all-to-all time inside
the pairs, in order), per rank, medians over steps.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from dsv3.config import ModelConfig, preset
from dsv3.layout import pipeline_bubble
from dsv3.model.transformer import Transformer
from dsv3.parallel.pipeline import PipelineParallel, PipelinePlan, StageModule, StepTally, label_counts, plan_pipeline
from dsv3.parallel.pipeline_overlap import run_in_order
from dsv3.testing.launch import launch

TIMED_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@dataclass(frozen=True)
class BubbleSpec:
    """One schedule on ``pp`` ranks, ``microbatches`` micro-batches of ``micro_batch`` sequences of
    ``seq`` tokens, a model of ``layers`` layers and width ``hidden``; ``overlap``: DualPipeV's
    OVERLAP_F_B pairs through the registered custom function (run in order)."""

    schedule: str
    pp: int = 2
    microbatches: int = 8
    micro_batch: int = 2
    seq: int = 64
    layers: int = 8
    hidden: int = 128
    steps: int = 3
    overlap: bool = False
    seed: int = 0
    ep: int = 1  # > 1: pp x ep processes, each stage's routed experts over its ep replicas (two-hop dispatch)

    @property
    def world(self) -> int:
        return self.pp * self.ep

    def config(self) -> ModelConfig:
        """nano's structure at the spec's width and depth (one MTP layer, MoE from layer 1)."""
        return preset("nano").replace(
            hidden_size=self.hidden, num_hidden_layers=self.layers, vocab_size=2048, intermediate_size=4 * self.hidden,
            moe_intermediate_size=self.hidden // 2, max_position_embeddings=max(128, self.seq),
        )

    def plan(self) -> PipelinePlan:
        return plan_pipeline(self.config(), self.pp, self.schedule, self.microbatches)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        tokens = torch.randint(0, self.config().vocab_size, (self.microbatches * self.micro_batch, self.seq + 1),
                               generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---- on P processes: the measured bubble and the saved activations ----------------------------------


class SavedBytes:
    """saved_tensors_hooks that count the bytes autograd holds for backward (parameters excluded): the live
    total and its peak."""

    def __init__(self, params) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class _Held:
    """A saved tensor whose bytes count as live until autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes):
        self.tensor, self.owner, self.nbytes = tensor, owner, tensor.numel() * tensor.element_size()
        owner.live += self.nbytes
        owner.peak = max(owner.peak, owner.live)

    def __del__(self):
        self.owner.live -= self.nbytes


def _time_stage_methods(stages, totals: dict[str, float]) -> None:
    """Wraps each torch stage's compute methods so that their time adds up in ``totals``."""
    for stage in stages:
        for name in TIMED_METHODS:
            method = getattr(stage, name)

            def timed(*args, _method=method, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    totals[_name] += time.perf_counter() - t0

            setattr(stage, name, timed)


def bubble_worker(rank: int, world: int, specs: list[BubbleSpec]) -> list[dict]:
    """This rank's compute time and wall time per measured step, and its peak saved bytes, per spec."""
    return [_measure(spec) for spec in specs]


def _measure(spec: BubbleSpec) -> dict:
    cfg = spec.config()
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    overlap = PairClock() if spec.schedule == "dualpipev" and (spec.overlap or spec.ep > 1) else None
    pipe = _pipeline(model, spec, overlap)
    input_ids, labels = spec.batch()
    pipe.forward_backward(input_ids, labels)  # warm-up; builds the schedule
    schedule = pipe.schedule
    _, totals = _instrument(schedule)
    saved = SavedBytes(pipe.parameters())
    compute, wall, pairs = [], [], []
    with AllToAllClock() as a2a:
        if overlap is not None:
            overlap.clock = a2a
        for step in range(spec.steps * (2 if overlap and spec.ep > 1 else 1)):
            if overlap is not None:  # with EP: in order and concurrent steps alternate (ratios of one run)
                overlap.start_step(concurrent=spec.ep > 1 and step % 2 == 1)
            for p in pipe.parameters():
                p.grad = None
            for key in totals:
                totals[key] = 0.0
            a2a.reset()
            dist.barrier()
            t0 = time.perf_counter()
            with saved.counting():
                pipe.forward_backward(input_ids, labels)
            wall.append(time.perf_counter() - t0)
            compute.append(sum(totals.values()))
            pairs.append(overlap.step_record(a2a) if overlap is not None else None)
    return {"compute_s": compute, "wall_s": wall, "peak_saved_bytes": saved.peak, "pairs": pairs,
            "stages": [m.stage for m in pipe.stage_modules]}


def _pipeline(model: Transformer, spec: BubbleSpec, overlap) -> PipelineParallel:
    """The spec's pipeline over this process's ranks: plain stages, or stages with EP (`parallelize`'s)."""
    if spec.ep == 1:
        return PipelineParallel(model, spec.plan(), overlap=overlap)
    from dsv3.layout import Layout
    from dsv3.parallel.parallelize import parallelize

    layout = Layout(pp=spec.pp, dp=spec.ep, ep=spec.ep, schedule=spec.schedule, microbatches=spec.microbatches)
    return parallelize(model, layout.check(spec.world), overlap=overlap).pipe


class AllToAllClock:
    """Times every ``torch.distributed.all_to_all_single`` (the EP dispatcher's collectives) from its launch
    to the end of its wait, while active; ``in_pairs`` only those launched inside an OVERLAP_F_B pair."""

    def __init__(self) -> None:
        self.total = self.in_pairs = 0.0
        self.pair_open = False
        self._original = None

    def reset(self) -> None:
        self.total = self.in_pairs = 0.0

    def __enter__(self) -> AllToAllClock:
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original

    def _timed(self, *args, **kwargs):
        t0, in_pair = time.perf_counter(), self.pair_open
        work = self._original(*args, **kwargs)
        if work is None:  # synchronous
            self._add(time.perf_counter() - t0, in_pair)
            return work
        return _TimedWork(work, lambda: self._add(time.perf_counter() - t0, in_pair))

    def _add(self, seconds: float, in_pair: bool) -> None:
        self.total += seconds
        if in_pair:
            self.in_pairs += seconds


class _TimedWork:
    """A collective's work handle whose ``wait`` reports when the collective finished."""

    def __init__(self, work, done) -> None:
        self.work, self.done = work, done

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        self.done()
        return out


class PairClock:
    """DualPipeV's OVERLAP_F_B function for the benchmark: runs each pair in order or concurrently (set per
    step) and times the pairs."""

    def __init__(self) -> None:
        self.concurrent, self.seconds, self.clock = False, 0.0, None

    def start_step(self, concurrent: bool) -> None:
        self.concurrent, self.seconds = concurrent, 0.0

    def __call__(self, forward, backward) -> None:
        from dsv3.parallel.pipeline_overlap import run_concurrently

        t0 = time.perf_counter()
        if self.clock is not None:
            self.clock.pair_open = True
        try:
            (run_concurrently if self.concurrent else run_in_order)(forward, backward)
        finally:
            if self.clock is not None:
                self.clock.pair_open = False
            self.seconds += time.perf_counter() - t0

    def step_record(self, clock: AllToAllClock) -> dict:
        """This step's pair time, all-to-all time (all, inside pairs) and mode."""
        return {"concurrent": self.concurrent, "pairs_s": self.seconds, "a2a_s": clock.total,
                "a2a_in_pairs_s": clock.in_pairs}


def _instrument(schedule):
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    totals = dict.fromkeys(TIMED_METHODS, 0.0)
    _time_stage_methods(stages, totals)
    return stages, totals


# ---- in one process: F, B, W of every stage ----------------------------------------------------------


def stage_costs(spec: BubbleSpec, repeats: int = 5) -> list[dict[str, float]]:
    """Median seconds of forward (F), full backward (B), and backward split into input (I) and weights (W)
    of every stage of the spec's plan, for one micro-batch, in this process."""
    cfg, plan = spec.config(), spec.plan()
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    tally = StepTally()
    input_ids, labels = (t[: spec.micro_batch] for t in spec.batch())
    tally.start(label_counts(labels, cfg.num_nextn_predict_layers), spec.micro_batch)
    hidden = torch.randn(spec.micro_batch, spec.seq, cfg.hidden_size) * 0.5
    costs = []
    for s in range(plan.num_stages):
        module = StageModule(model, plan, s, tally)
        x = input_ids if module.first else hidden
        costs.append(_median_costs(module, x, input_ids, labels, repeats))
    return costs


def _median_costs(module: StageModule, x, input_ids, labels, repeats: int) -> dict[str, float]:
    rounds = [_one_round(module, x, input_ids, labels) for _ in range(repeats + 1)][1:]  # the first warms up
    return {key: statistics.median(r[key] for r in rounds) for key in ("F", "B", "I", "W")}


def _one_round(module: StageModule, x, input_ids, labels) -> dict[str, float]:
    """One forward + full backward, then one forward + backward split into input and weight parts."""
    times = {}
    for split in (False, True):
        inp = x if module.first else x.detach().requires_grad_()
        t0 = time.perf_counter()
        out = module(inp, tokens=input_ids, labels=labels)
        t1 = time.perf_counter()
        grad = torch.ones_like(out)
        if not split:
            out.backward(grad)
            times["F"], times["B"] = t1 - t0, time.perf_counter() - t1
        elif module.first:  # no input gradient to send back: the whole backward is the weights'
            out.backward(grad)
            times["I"], times["W"] = 0.0, time.perf_counter() - t1
        else:
            params = list(module.parameters())
            _, groups = stage_backward_input([out], [grad], [inp], iter(params))
            t2 = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            times["I"], times["W"] = t2 - t1, time.perf_counter() - t2
        module.zero_grad(set_to_none=True)
    return times


# ---- the report --------------------------------------------------------------------------------------


OVERLAP_API = (
    "ScheduleDualPipeV emits OVERLAP_F_B actions (a FORWARD of one micro-batch paired with a FULL_BACKWARD "
    "of another, on the rank's two stages); register_custom_function(OVERLAP_F_B, fn) replaces the default "
    "(the two run in order) with fn(action, ctx): action.sub_actions holds the pair, ctx the schedule and "
    "the micro-batch args, kwargs and targets. fn must redo the runtime's bookkeeping (receive waits, loss, "
    "passing activations and gradients between the rank's stages, backward counts) from the schedule's "
    "private fields; dsv3.parallel.pipeline_overlap.register_overlap does that once and leaves "
    "overlap(forward, backward) to the caller. Rows with overlap=true and ep=1 ran through it, in order; "
    "rows with ep>1 alternate in-order steps and concurrent ones (run_concurrently: the backward half on a "
    "second thread, each stage's MoE all-to-alls on its own process groups), and comm_hidden_share is "
    "(pair time in order - pair time concurrent) / all-to-all time inside the pairs in order."
)


def hidden_share(pairs: list[dict | None]) -> dict | None:
    """One rank's share of all-to-all time hidden by DualPipeV's overlap, from alternating in-order and
    concurrent steps: (pair time in order - pair time concurrent) / all-to-all time inside the pairs in
    order (medians over steps). 1: all hidden; 0: none; below 0: the overlap cost more than it hid."""
    in_order = [p for p in pairs if p is not None and not p["concurrent"]]
    overlapped = [p for p in pairs if p is not None and p["concurrent"]]
    if not in_order or not overlapped:
        return None
    pairs_in_order = statistics.median(p["pairs_s"] for p in in_order)
    pairs_overlapped = statistics.median(p["pairs_s"] for p in overlapped)
    a2a = statistics.median(p["a2a_in_pairs_s"] for p in in_order)
    return {"pairs_in_order_s": pairs_in_order, "pairs_overlapped_s": pairs_overlapped, "a2a_in_pairs_s": a2a,
            "a2a_step_s": statistics.median(p["a2a_s"] for p in in_order),
            "hidden": (pairs_in_order - pairs_overlapped) / a2a if a2a > 0 else None}


def _communication(ranks: list[dict]) -> dict:
    """The report's all-to-all figures: per rank, and the share hidden averaged over ranks."""
    per_rank = [hidden_share(r["pairs"]) for r in ranks]
    if any(h is None for h in per_rank):
        return {"comm_hidden_share": None, "comm_per_rank": None}
    shares = [h["hidden"] for h in per_rank if h["hidden"] is not None]
    rounded = [{k: round(v, 5) if v is not None else None for k, v in h.items()} for h in per_rank]
    return {"comm_hidden_share": round(statistics.mean(shares), 4) if shares else None, "comm_per_rank": rounded}


def summarize(spec: BubbleSpec, ranks: list[dict], costs: list[dict[str, float]]) -> dict:
    """One report row: the measured bubble (median over steps) next to the formula's, and with EP under
    DualPipeV the share of all-to-all time its overlap hides."""
    plan = spec.plan()
    P = spec.pp
    # the bubble of the in-order steps (a concurrent step's two halves count their time twice)
    steps = [i for i, pair in enumerate(ranks[0]["pairs"]) if pair is None or not pair["concurrent"]]
    measured = [1 - sum(r["compute_s"][i] for r in ranks) / (len(ranks) * max(r["wall_s"][i] for r in ranks))
                for i in steps]
    F, B, I, W = (statistics.mean(c[k] for c in costs) for k in ("F", "B", "I", "W"))
    per_rank = spec.microbatches * (plan.num_stages // P) * (F + B)  # ideal compute of one rank
    name, bubble_s = pipeline_bubble(spec.schedule, P, F, B, W)
    return {
        "schedule": spec.schedule, "pp": P,
        "overlap_f_b_registered": spec.overlap or (spec.schedule == "dualpipev" and spec.ep > 1),
        "stages": plan.num_stages, "microbatches": spec.microbatches, "layers_per_stage": list(plan.layers),
        "measured_bubble": round(statistics.median(measured), 4),
        "measured_bubble_per_step": [round(b, 4) for b in measured],
        "step_wall_s": round(statistics.median(max(r["wall_s"][i] for r in ranks) for i in steps), 4),
        "formula": name,
        "formula_bubble_s": None if bubble_s is None else round(bubble_s, 5),
        "formula_bubble": None if bubble_s is None else round(bubble_s / (bubble_s + per_rank), 4),
        "F_s": round(F, 5), "B_s": round(B, 5), "I_s": round(I, 5), "W_s": round(W, 5),
        "peak_saved_activation_bytes_per_rank": [r["peak_saved_bytes"] for r in ranks],
        "ep": spec.ep, "processes": len(ranks),
    } | _communication(ranks)


def run_bubble_bench(specs: list[BubbleSpec], timeout_s: float = 600.0) -> dict:
    """All specs (same ``pp``) on one set of gloo processes; F, B, W here. Returns the JSON report."""
    if len({s.world for s in specs}) != 1:
        raise ValueError("one number of processes per run")
    results = launch(bubble_worker, specs[0].world, (specs,), timeout_s=timeout_s)
    torch.set_num_threads(1)  # as each worker runs
    rows = [summarize(spec, [r[i] for r in results], stage_costs(spec)) for i, spec in enumerate(specs)]
    return {"backend": "gloo", "device": "cpu", "spec": asdict(specs[0]) | {"schedule": None, "overlap": None},
            "rows": rows, "overlap_f_b_api": OVERLAP_API}
