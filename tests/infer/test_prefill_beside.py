"""Prefill beside the decode steps (`serve --prefill-threads N`): a long prompt prefilled on a thread of its own
gives the tokens a whole prefill gives, while the running streams go on decoding; a cancelled or failing one
gives its pages back and harms no other request."""

import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsv3.infer.chunked_prefill import ChunkedPrefill
from dsv3.infer.engine import Engine, Event, Request
from dsv3.infer.prefill_beside import Cores, yield_to_others
from dsv3.infer.sampling import GREEDY
from dsv3.infer.scheduler import Scheduler

from .conftest import cached_prefix_engine

PROMPT = [random.Random(0).randrange(300) for _ in range(300)]
DEADLINE_S = 60


def beside_then_decode(engine: Engine, request: Request) -> tuple[list[int], int]:
    """(tokens, MTP drafts accepted) of ``request`` prefilled as the prefill beside the steps does it (every slot
    but the last through the modules, after any cached prefix), then decoded to the end."""
    work = ChunkedPrefill(engine, request, 16)
    work.reserve(len(request.prompt_ids) - 1)
    work.prefill_through_modules(len(request.prompt_ids) - 1)
    batch = work.advance()  # the last slot: prefilled by the request's own batch, which samples
    tokens = [t for ev in batch.first_events for t in ev.token_ids]
    while batch.rows:
        tokens += [t for ev in batch.step() for t in ev.token_ids]
    return tokens, batch.stats.accepted


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_all_but_the_last_slot_through_the_modules_gives_the_whole_prefills_tokens_and_drafts(long_model,
                                                                                            speculative):
    engine = Engine(long_model, speculative=speculative, eos_token_ids=frozenset())
    want = engine.generate([Request(PROMPT, 12, GREEDY)])[0].token_ids
    accepted = engine.last_stats.accepted
    tokens, got_accepted = beside_then_decode(engine, Request(PROMPT, 12, GREEDY))
    assert tokens == want
    if speculative:  # the MTP layer's cache entries are the whole prefill's
        assert got_accepted == accepted


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_after_a_cached_prefix_only_the_rest_goes_through_the_modules(long_model, speculative):
    engine, want = cached_prefix_engine(long_model, PROMPT, speculative)
    request = Request(PROMPT, 12, GREEDY)
    assert beside_then_decode(engine, request)[0] == want and request.cached_tokens == 192


class Held:
    """``ChunkedPrefill.prefill_through_modules`` made to wait until ``go`` is set (``raises``: then fail)."""

    def __init__(self, monkeypatch, raises: Exception | None = None):
        self.started, self.go, self.threads = threading.Event(), threading.Event(), []
        original = ChunkedPrefill.prefill_through_modules

        def held(work, end):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            self.go.wait(DEADLINE_S)
            if raises is not None:
                raise raises
            original(work, end)

        monkeypatch.setattr(ChunkedPrefill, "prefill_through_modules", held)


def serve_beside(engine: Engine, held: Held, long: Request, until_released,
                 on_long) -> tuple[list[Event], int, Scheduler]:
    """A scheduler with one decoding stream; ``long`` arrives, and while its prefill is held the stream's tokens
    are counted; ``until_released(scheduler)`` then runs and ``held.go`` is set; once that prefill has ended
    (and a few steps more) the stream is cancelled. Returns (the stream's events, its tokens while the prefill
    was held, the stopped scheduler)."""
    engine.max_prefill_tokens, engine.prefill_threads = 16, 1
    scheduler = Scheduler(engine, max_batch=4)
    stream, got = Request([5, 6, 7], 100_000, GREEDY), []
    scheduler.start()
    try:
        scheduler.metrics.arrived(stream)
        scheduler.pending.put((stream, got.append))
        deadline = time.time() + DEADLINE_S
        while not got and time.time() < deadline:
            time.sleep(0.001)
        scheduler.metrics.arrived(long)
        scheduler.pending.put((long, on_long))
        assert held.started.wait(DEADLINE_S)
        seen = len(got)
        while len(got) < seen + 20 and time.time() < deadline:
            time.sleep(0.001)
        during = len(got) - seen
        assert scheduler.metrics.waiting() == 1 and scheduler.beside is not None
        until_released(scheduler)
        held.go.set()
        while scheduler.beside is not None and time.time() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # a few more steps after it ended
        stream.cancelled = True
        while scheduler.batch is not None and time.time() < deadline:  # every row gone, its pages back
            time.sleep(0.001)
    finally:
        scheduler.stop()
    return got, during, scheduler


def test_the_streams_decode_while_a_long_prompt_is_prefilled_beside_them(long_model, monkeypatch):
    """While the prompt's prefill (held here until the stream has had 20 tokens) runs on a thread of its own,
    the stream keeps getting tokens; the prompt's reply is then the one a whole prefill gives."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    want = engine.generate([Request(PROMPT, 4, GREEDY)])[0].token_ids
    held, replies = Held(monkeypatch), []
    free = engine.pool.free
    _, during, scheduler = serve_beside(engine, held, Request(PROMPT, 4, GREEDY), lambda s: None, replies.append)
    assert during >= 20 and held.threads == ["dsv3-prefill"]
    assert [t for ev in replies for t in ev.token_ids] == want and replies[-1].finish_reason == "length"
    assert engine.pool.free == free  # every page back (the finished prompt's blocks: none, no prefix cache)


def test_the_prefills_thread_count_is_its_own(long_model, monkeypatch):
    """The prefill sets its torch threads (1) on its own thread; the decode thread keeps its count (2), which the
    fast decode step reads for its kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine, seen = Engine(long_model, eos_token_ids=frozenset()), []
        serve_beside(engine, Held(monkeypatch), Request(PROMPT, 2, GREEDY), lambda s: None,
                     lambda ev: seen.append(torch.get_num_threads()))  # called on the decode thread
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2]


def test_a_request_cancelled_while_prefilled_beside_gives_its_pages_back(long_model, monkeypatch):
    engine = Engine(long_model, eos_token_ids=frozenset())
    held, replies, long = Held(monkeypatch), [], Request(PROMPT, 4, GREEDY)
    free = engine.pool.free

    def cancel(scheduler):
        long.cancelled = True

    _, _, scheduler = serve_beside(engine, held, long, cancel, replies.append)
    assert not replies and id(long) not in scheduler.listeners
    assert scheduler.metrics.requests["cancelled"] >= 1 and engine.pool.free == free


def test_a_prefill_beside_that_fails_fails_its_request_alone(long_model, monkeypatch):
    engine = Engine(long_model, eos_token_ids=frozenset())
    held, replies = Held(monkeypatch, raises=RuntimeError("the prefill broke")), []
    free = engine.pool.free
    got, _, scheduler = serve_beside(engine, held, Request(PROMPT, 4, GREEDY), lambda s: None, replies.append)
    assert len(replies) == 1 and isinstance(replies[0], RuntimeError)
    assert scheduler.metrics.requests["error"] == 1 and engine.pool.free == free
    assert all(not isinstance(ev, Exception) for ev in got) and len(got) > 20  # the stream went on


def test_a_second_long_prompt_rides_the_steps_while_one_is_prefilled_beside(long_model, monkeypatch):
    """One prompt at a time is prefilled beside the steps; another arriving meanwhile is chunked along them,
    and both replies are whole prefills'."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    want = [engine.generate([Request(p, 3, GREEDY)])[0].token_ids for p in (PROMPT, PROMPT[::-1])]
    held, first, second = Held(monkeypatch), [], []

    def second_arrives(scheduler):
        scheduler.pending.put((Request(PROMPT[::-1], 3, GREEDY), second.append))
        deadline = time.time() + DEADLINE_S
        while not any(ev.finish_reason for ev in second) and time.time() < deadline:
            time.sleep(0.001)
        assert any(ev.finish_reason for ev in second) and not first  # done while the first one is held

    serve_beside(engine, held, Request(PROMPT, 3, GREEDY), second_arrives, first.append)
    assert held.threads == ["dsv3-prefill"]
    assert [[t for ev in replies for t in ev.token_ids] for replies in (first, second)] == want


def test_the_prefill_thread_takes_only_cpu_time_no_other_thread_wants():
    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE on this OS")
    policy = []

    def run():
        yield_to_others()
        policy.append(os.sched_getscheduler(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert policy == [os.SCHED_IDLE] and os.sched_getscheduler(0) != os.SCHED_IDLE  # that thread's alone


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity calls on this OS")
def test_the_cores_are_split_the_last_ones_for_the_prefill():
    allowed = sorted(os.sched_getaffinity(0))
    assert Cores.split(len(allowed), 1) is None  # the decode would have none left
    assert Cores.split(1, len(allowed)) is None  # nor a core for each of its threads
    if len(allowed) >= 2:
        cores = Cores.split(1, 1)
        assert cores.prefill == {allowed[-1]} and cores.decode == set(allowed[:-1])


def test_the_benchmark_reads_its_server_configurations():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import chunked_prefill

    assert chunked_prefill.server_flags("256") == ("--max-prefill-tokens", "256")
    assert chunked_prefill.server_flags("256/1") == ("--max-prefill-tokens", "256", "--prefill-threads", "1")


def test_the_server_says_so_when_the_decode_and_the_prefill_outnumber_the_cores(long_model, capsys):
    from dsv3.infer.cli import beside_threads

    engine, cores = Engine(long_model), os.cpu_count()
    assert beside_threads(engine, 1, cores) == 1
    assert capsys.readouterr().err == f"note: {cores} decode + 1 prefill threads on {cores} cores: prefills " \
                                      f"starve; try --threads {max(cores - 1, 1)}\n"
    if cores >= 2:
        assert beside_threads(engine, 1, cores - 1) == 1 and capsys.readouterr().err == ""
    assert beside_threads(engine, 0, cores) == 0
