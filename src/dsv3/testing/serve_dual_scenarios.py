"""Multi-process checks and measurements of dual micro-batch decode in an EP serving group, run through
`launch` by the tests and by ``benchmarks/serve_dual_microbatch.py``.

``dual_generation``: every rank drives the server's own `RankWorker` through a fixed schedule of control
messages (requests arriving at given steps on given ranks, so that ranks hold odd and even numbers of rows,
one rank idles, and rows join mid-decode); the caller compares the greedy tokens with one process.
``decode_step_times``: every rank decodes a full batch of its own, alternating single and dual mode, and
times each step and (single mode) the time spent in the expert exchanges.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dsv3.infer.cluster.lockstep import Lockstep, make_lockstep, use_micro_batches
from dsv3.infer.cluster.rank import Control, RankWorker, WireRequest
from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import GREEDY

# (step, rank, prompt index): when and where each request arrives
Schedule = list[tuple[int, int, int]]


def dual_generation(rank: int, world: int, checkpoint: str, prompts: list[list[int]], max_tokens: list[int],
                    schedule: Schedule, speculative: bool = False) -> dict:
    """This rank's greedy tokens {prompt index: ids} under ``schedule`` with ``--micro-batches 2``, and how
    many of its decode steps ran split in two halves."""
    import dsv3

    engine = Engine(dsv3.load_pretrained(checkpoint), None, speculative=speculative)
    lockstep = make_lockstep(engine.model, [list(range(world))])
    use_micro_batches(engine, lockstep, 2)
    worker = RankWorker(engine, lockstep, rank)
    tokens: dict[int, list[int]] = {}
    step, last = 0, max(s for s, _, _ in schedule)
    while True:
        new: dict[int, list[WireRequest]] = {}
        for when, r, i in schedule:
            if when == step:
                new.setdefault(r, []).append(WireRequest(i, prompts[i], max_tokens[i], GREEDY, frozenset(), (), None))
        for ev in worker.step(Control(new=new)).events:
            tokens.setdefault(ev.rid, []).extend(ev.token_ids)
        active = torch.tensor([worker.active])
        dist.all_reduce(active)
        step += 1
        if step > last and not int(active):
            return {"tokens": tokens, "split_steps": lockstep.split_forwards, "rounds": lockstep.rounds}


def reference_tokens(checkpoint: str, prompts: list[list[int]], max_tokens: list[int],
                     speculative: bool = False) -> list[list[int]]:
    """One process's greedy completions of the prompts, decoded together."""
    import dsv3

    engine = Engine(dsv3.load_pretrained(checkpoint), None, speculative=speculative)
    return [r.token_ids for r in engine.generate([Request(p, n) for p, n in zip(prompts, max_tokens, strict=True)])]


# ---- measurement ------------------------------------------------------------------------------------


def decode_step_times(rank: int, world: int, preset: str, rows: int, prompt_len: int, steps: int,
                      repeats: int, wire_latency_s: float = 0.0, seed: int = 0) -> dict:
    """``repeats`` batches of ``rows`` rows on every rank, each prefilled and then decoded ``2 * steps`` steps
    with single and dual mode alternating step by step (so that load on the machine hits both alike). Per
    repeat and mode, medians over the steps: the step time (every rank steps together: the group's step)
    and the time this rank waited on the exchanges (blocked on an all-to-all or in a round's gather).
    ``wire_latency_s`` > 0 emulates a network: every all-to-all completes no sooner than that long after it
    was issued (a sleep, which costs no CPU)."""
    from dsv3.config import preset as named
    from dsv3.model.transformer import Transformer

    clock = _WaitClock(wire_latency_s)
    torch.manual_seed(seed)  # the same weights on every rank
    model = Transformer(named(preset)).eval()
    engine = Engine(model, None)
    lockstep = make_lockstep(model, [list(range(world))])
    g = torch.Generator().manual_seed(seed + 1 + rank)
    vocab = model.config.vocab_size
    out: dict[str, list[float]] = {key: [] for key in ("single_s", "dual_s", "single_wait_s", "dual_wait_s")}
    for _ in range(repeats):
        requests = [Request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), 2 * steps + 1,
                            ignore_eos=True) for _ in range(rows)]
        use_micro_batches(engine, lockstep, 1)
        batch = engine.start(requests)
        lockstep.finish()
        seen: dict[str, list[float]] = {key: [] for key in out}
        for k in range(2 * steps):
            mode = "single" if k % 2 == 0 else "dual"
            use_micro_batches(engine, lockstep, 1 if mode == "single" else 2)  # a step boundary, every rank alike
            seconds, waited = _timed_step(batch, lockstep, clock)
            seen[f"{mode}_s"].append(seconds)
            seen[f"{mode}_wait_s"].append(waited)
        for key, values in seen.items():
            out[key].append(statistics.median(values))
    return out


def _timed_step(batch, lockstep: Lockstep, clock: _WaitClock) -> tuple[float, float]:
    """One decode step of the group: (seconds, seconds this rank waited on the exchanges)."""
    dist.barrier()
    before = clock.waited + lockstep.gather_s
    t0 = time.perf_counter()
    batch.step()
    lockstep.finish()
    return time.perf_counter() - t0, clock.waited + lockstep.gather_s - before


class _WaitClock:
    """Wraps this process's ``dist.all_to_all_single`` (the exchanges' collectives) so that the time spent
    blocked on them adds up in ``waited``; with ``latency`` > 0 each also completes no sooner than that long
    after it was issued (an emulated network: a sleep, which costs no CPU). Measurement only."""

    def __init__(self, latency: float):
        self.latency, self.waited = latency, 0.0
        real = dist.all_to_all_single

        def timed(*args, async_op: bool = False, **kwargs):
            work = _TimedWork(real(*args, async_op=True, **kwargs), time.perf_counter() + latency, self)
            if async_op:
                return work
            work.wait()
            return None

        dist.all_to_all_single = timed


class _TimedWork:
    """An all-to-all's handle whose ``wait`` returns no sooner than ``ready`` and is timed by ``clock``."""

    def __init__(self, work, ready: float, clock: _WaitClock):
        self.work, self.ready, self.clock = work, ready, clock

    def wait(self):
        t0 = time.perf_counter()
        left = self.ready - t0
        if left > 0:
            time.sleep(left)
        done = self.work.wait()
        self.clock.waited += time.perf_counter() - t0
        return done
