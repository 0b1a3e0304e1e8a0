"""Chunked prefill (`serve --max-prefill-tokens N`): a long prompt prefilled a chunk at a time between the
running batch's decode steps gives the tokens a whole prefill gives, and lets the running streams go on."""

import random
import time

import pytest

from dsv3.cli import main
from dsv3.infer.chunked_prefill import ChunkedPrefill
from dsv3.infer.engine import Engine, Event, Request
from dsv3.infer.sampling import GREEDY
from dsv3.infer.scheduler import Scheduler
from dsv3.kernels.decode import FastDecode

from .conftest import cached_prefix_engine, tiny_model

PROMPT = [random.Random(0).randrange(300) for _ in range(300)]


def chunked(engine: Engine, request: Request, chunk_tokens: int) -> tuple[list[int], int, int]:
    """(tokens, chunks run before the last, MTP drafts accepted) of ``request`` prefilled ``chunk_tokens``
    at a time, then decoded to the end."""
    work, batch, chunks = ChunkedPrefill(engine, request, chunk_tokens), None, 0
    while batch is None:
        batch = work.advance()
        chunks += batch is None
    tokens = [t for ev in batch.first_events for t in ev.token_ids]
    while batch.rows:
        tokens += [t for ev in batch.step() for t in ev.token_ids]
    return tokens, chunks, batch.stats.accepted


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_chunks_of_any_size_give_the_whole_prefills_greedy_tokens_and_drafts(long_model, speculative):
    engine = Engine(long_model, speculative=speculative, eos_token_ids=frozenset())
    whole = engine.stream([Request(PROMPT, 12, GREEDY)])
    want = [t for ev in whole for t in ev.token_ids]
    accepted = engine.last_stats.accepted
    for size, chunks in ((1, 299), (7, 42), (64, 4), (299, 1), (300, 0)):
        tokens, ran, got_accepted = chunked(engine, Request(PROMPT, 12, GREEDY), size)
        assert (tokens, ran) == (want, chunks), size
        if speculative:  # the MTP layer's cache entries of every chunk are the whole prefill's
            assert got_accepted == accepted, size


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_a_cached_prefix_is_copied_and_only_the_rest_is_chunked(long_model, speculative):
    engine, want = cached_prefix_engine(long_model, PROMPT, speculative)
    request = Request(PROMPT, 12, GREEDY)
    tokens, chunks, _ = chunked(engine, request, 32)
    assert request.cached_tokens == 192 and tokens == want
    assert chunks == (300 - 192 - speculative - 1) // 32  # with MTP the prefix's last slot is prefilled again
    again = Request(PROMPT, 12, GREEDY)  # the chunked prompt's own blocks were cached as a whole prefill's
    assert chunked(engine, again, 32)[0] == want and again.cached_tokens == 288


def test_running_streams_get_a_token_per_chunk_while_a_long_prompt_is_prefilled(long_model, tokenizer):
    """The scheduler's events in the order it delivers them: between a long prompt's arrival and its first
    token, the stream that was decoding gets about a token per chunk (without chunking the prefill is one
    piece of work, and it gets at most the one step that was under way). The long prompt's reply is the one
    a whole prefill gives."""
    engine = Engine(long_model, tokenizer, eos_token_ids=frozenset())
    want = engine.generate([Request(PROMPT, 4, GREEDY)])[0].token_ids
    engine.max_prefill_tokens = 16
    scheduler = Scheduler(engine, max_batch=4)
    delivered: list[tuple[str, Event]] = []
    running, long = Request([5, 6, 7], 1000, GREEDY), Request(PROMPT, 4, GREEDY)
    scheduler.start()
    try:
        scheduler.pending.put((running, lambda ev: delivered.append(("running", ev))))
        deadline = time.time() + 60
        while not delivered and time.time() < deadline:
            time.sleep(0.001)
        arrived = len(delivered)
        scheduler.pending.put((long, lambda ev: delivered.append(("long", ev))))
        while not any(ev.finish_reason for who, ev in delivered if who == "long") and time.time() < deadline:
            time.sleep(0.01)
        running.cancelled = True
    finally:
        scheduler.stop()
    order = [who for who, _ in delivered[arrived:]]
    assert [t for who, ev in delivered if who == "long" for t in ev.token_ids] == want
    assert order.index("long") >= 300 // 16 - 1, order.index("long")


def test_a_request_cancelled_between_chunks_leaves_the_queue_and_frees_its_place(long_model):
    """A client that goes away while its prompt is being chunked (beside a decoding stream: prompts are
    chunked only while others decode): the request is dropped at the next chunk, counted as cancelled,
    and its place in the batch goes to the next request."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    engine.max_prefill_tokens = 1
    scheduler = Scheduler(engine, max_batch=2)
    delivered: list[Event] = []
    stream = Request([1, 2], 100_000, GREEDY)
    gone, waiting = Request(PROMPT, 4, GREEDY), Request([5, 6, 7], 3, GREEDY)
    scheduler.start()
    try:
        scheduler.metrics.arrived(stream)
        scheduler.pending.put((stream, lambda ev: None))
        deadline = time.time() + 60
        while scheduler.batch is None and time.time() < deadline:
            time.sleep(0.001)
        for request in (gone, waiting):
            scheduler.metrics.arrived(request)  # as Scheduler.submit does
            scheduler.pending.put((request, delivered.append))
        while not (scheduler.prefilling and isinstance(scheduler.prefilling[0], ChunkedPrefill)
                   and scheduler.prefilling[0].done >= 8) and time.time() < deadline:
            time.sleep(0.001)
        assert scheduler.metrics.waiting() == 2  # /metrics: the one being chunked and the one queued behind it
        gone.cancelled = True
        while not any(ev.finish_reason for ev in delivered) and time.time() < deadline:
            time.sleep(0.01)
        stream.cancelled = True
    finally:
        scheduler.stop()
    assert all(ev.request is waiting for ev in delivered)  # the cancelled request gets no event
    assert sum(len(ev.token_ids) for ev in delivered) == 3 and delivered[-1].finish_reason == "length"
    assert scheduler.metrics.requests["cancelled"] >= 1 and scheduler.metrics.requests["length"] == 1
    assert not scheduler.prefilling and id(gone) not in scheduler.listeners


def test_a_prompt_is_prefilled_whole_when_nothing_decodes(long_model):
    """Chunks exist to let running streams go on; with none running, the prompt is prefilled in one piece
    (each chunk is a forward with its own fixed cost, so chunking alone only delays the first token)."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    engine.max_prefill_tokens = 16
    scheduler = Scheduler(engine, max_batch=2)
    chunked_seen, delivered = [], []
    scheduler.start()
    try:
        request = Request(PROMPT, 2, GREEDY)
        scheduler.metrics.arrived(request)
        scheduler.pending.put((request, delivered.append))
        deadline = time.time() + 60
        while not any(ev.finish_reason for ev in delivered) and time.time() < deadline:
            chunked_seen += [w for w in list(scheduler.prefilling) if isinstance(w, ChunkedPrefill)]
            time.sleep(0.0005)
    finally:
        scheduler.stop()
    assert not chunked_seen and sum(len(ev.token_ids) for ev in delivered) == 2


@pytest.mark.parametrize("flags, message", [
    (["--max-prefill-tokens", "-1"], "--max-prefill-tokens must be >= 0, got -1"),
    (["--ep", "2", "--max-prefill-tokens", "64"], "drop --max-prefill-tokens"),
    (["--prefill-threads", "-1"], "--prefill-threads must be >= 0, got -1"),
    (["--max-prefill-tokens", "0", "--prefill-threads", "1"], "--max-prefill-tokens 0 prefills every prompt whole"),
    (["--ep", "2", "--prefill-threads", "1"], "drop --prefill-threads"),
])
def test_bad_prefill_flags_are_one_error_line(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    tiny_model(layers=1).save_pretrained(tmp_path)
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_every_chunk_runs_on_the_decode_steps_path_not_the_modules(long_model, monkeypatch):
    """A chunk (the first at slot 0 and the last, which samples) runs on the engine's decode step
    (FastDecode's kernels), whose fixed cost is a fraction of the modules' forward."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    assert isinstance(engine.decoder, FastDecode)
    want = engine.generate([Request(PROMPT, 4, GREEDY)])[0].token_ids
    calls = []
    original = engine.decoder.hidden_states
    monkeypatch.setattr(engine.decoder, "hidden_states",
                        lambda *a, **k: calls.append(k["start_pos"]) or original(*a, **k))
    monkeypatch.setattr(long_model, "hidden_states", lambda *a, **k: pytest.fail("a chunk ran through the modules"))
    work, batch = ChunkedPrefill(engine, Request(PROMPT, 4, GREEDY), 64), None
    while batch is None:
        batch = work.advance()
    assert calls == [0, 64, 128, 192, 256]
    monkeypatch.undo()
    tokens = [t for ev in batch.first_events for t in ev.token_ids]
    while batch.rows:
        tokens += [t for ev in batch.step() for t in ev.token_ids]
    assert tokens == want


def test_a_time_budget_sizes_each_chunk_from_the_last_ones_cost(long_model):
    """Given a budget, a chunk holds as many tokens as fit in it at the last chunk's measured cost per
    token (the first: ``first``), at least 1 and at most ``chunk_tokens``; without one, ``chunk_tokens``."""
    work = ChunkedPrefill(Engine(long_model, eos_token_ids=frozenset()), Request(PROMPT, 4, GREEDY), 32)
    assert work.next_tokens() == 32 and work.next_tokens(0.01, first=5) == 5 and work.next_tokens(0.01, 99) == 32
    assert work.advance(0.01, first=5) is None and work.done == 5 and work.seconds_per_token > 0
    work.seconds_per_token = 0.002
    assert (work.next_tokens(0.01), work.next_tokens(0.0001), work.next_tokens(1.0)) == (5, 1, 32)
    assert work.next_tokens(None) == 32


def test_the_scheduler_budgets_a_chunk_at_the_running_batchs_recent_step_time(long_model):
    """The budget is the mean time of the decode steps run since the last chunk (the last one known when
    none ran since), from the batch's own counters."""
    scheduler = Scheduler(Engine(long_model, eos_token_ids=frozenset()))
    batch = scheduler.batch = scheduler.engine.start([Request([1, 2, 3], 50, GREEDY)])
    assert scheduler._recent_step_s() is None  # no step yet
    batch.stats.decode_s, batch.stats.main_forwards = 0.03, 3
    assert scheduler._recent_step_s() == pytest.approx(0.01)
    batch.stats.decode_s, batch.stats.main_forwards = 0.07, 5
    assert scheduler._recent_step_s() == pytest.approx(0.02)
    assert scheduler._recent_step_s() == pytest.approx(0.02)  # no step since: the last one known


def decode_with_riders(engine: Engine, streams: list[Request], request: Request,
                       size: int) -> tuple[dict, list[int], int]:
    """The streams decoded while ``request``'s prompt rides along their steps ``size`` tokens at a time (its last
    chunk prefilled by its own batch, which then joins): (each stream's tokens by id, the request's tokens,
    steps that carried a chunk)."""
    batch = engine.start(streams)
    got = {id(r): [t for ev in batch.first_events if ev.request is r for t in ev.token_ids] for r in streams}
    work, rides = ChunkedPrefill(engine, request, 64), 0
    while (rider := work.rider(size)) is not None:
        for ev in batch.step(rider):
            got[id(ev.request)] += ev.token_ids
        assert rider.ridden
        work.rode(rider, 0.001)
        rides += 1
    fresh = work.advance()
    tokens = [t for ev in fresh.first_events for t in ev.token_ids]
    batch.merge(fresh)
    while batch.rows:
        for ev in batch.step():
            if ev.request is request:
                tokens += ev.token_ids
            else:
                got[id(ev.request)] += ev.token_ids
    return got, tokens, rides


@pytest.mark.parametrize("size", [1, 5, 13])
def test_a_prompt_riding_the_streams_steps_changes_no_token_of_theirs_or_its_own(long_model, size):
    """A long prompt's chunks as extra rows of the running batch's decode steps: the streams (one shorter and
    one longer than the chunks' slots, so that the step's slot is sometimes theirs and sometimes the prompt's)
    decode as they do alone, and the prompt's reply is a whole prefill's."""
    engine = Engine(long_model, eos_token_ids=frozenset())
    want = engine.generate([Request(PROMPT, 6, GREEDY)])[0].token_ids
    prompts = [[5, 6, 7], PROMPT[:150]]
    alone = [r.token_ids for r in engine.generate([Request(p, 400, GREEDY) for p in prompts])]
    streams = [Request(p, 400, GREEDY) for p in prompts]
    got, tokens, rides = decode_with_riders(engine, streams, Request(PROMPT, 6, GREEDY), size)
    assert rides == (len(PROMPT) - 1) // size
    assert [got[id(r)] for r in streams] == alone and tokens == want


def test_the_scheduler_lets_every_chunk_but_the_last_ride_a_decode_step(long_model, monkeypatch):
    """Under the scheduler a long prompt's chunks ride the running batch's steps, one after another from the
    prompt's arrival to its last chunk (which its own batch prefills), and its reply is a whole prefill's."""
    from dsv3.infer.engine import Batch

    carried = []
    original = Batch.step
    monkeypatch.setattr(Batch, "step", lambda self, rider=None, **kw: carried.append(rider is not None)
                        or original(self, rider, **kw))
    engine = Engine(long_model, eos_token_ids=frozenset())
    want = engine.generate([Request(PROMPT, 4, GREEDY)])[0].token_ids
    engine.max_prefill_tokens = 8
    scheduler = Scheduler(engine, max_batch=4)
    delivered: list[Event] = []
    stream, long = Request([5, 6, 7], 100_000, GREEDY), Request(PROMPT, 4, GREEDY)
    scheduler.start()
    try:
        scheduler.pending.put((stream, lambda ev: None))
        deadline = time.time() + 60
        while scheduler.batch is None and time.time() < deadline:
            time.sleep(0.001)
        scheduler.pending.put((long, delivered.append))
        while not any(ev.finish_reason for ev in delivered) and time.time() < deadline:
            time.sleep(0.01)
        stream.cancelled = True
    finally:
        scheduler.stop()
    assert [t for ev in delivered for t in ev.token_ids] == want
    runs = "".join("r" if c else "." for c in carried).strip(".").split(".")
    assert len(runs) == 1 and len(runs[0]) >= (300 - 8) // 8  # at most 8 tokens a chunk


def test_a_riders_tokens_follow_the_time_of_the_step_that_carried_the_last_one(long_model):
    """The first rider holds a token per row; each next one the last one's tokens scaled by how far its step
    was from ``STREAM_SLOWDOWN`` times the streams' step when the first one rode; at least a token per row
    (the prompt goes on when the streams' own steps have grown past the target), at most the chunk size and
    what one kernel call takes beside the rows."""
    from dsv3.infer.rider_pace import STREAM_SLOWDOWN

    work = ChunkedPrefill(Engine(long_model, eos_token_ids=frozenset()), Request(PROMPT, 4, GREEDY), 32)
    size = work.rider_tokens
    assert size(0.004, 4) == 4
    target = STREAM_SLOWDOWN * 0.004
    assert work.pace.target_s == target
    work.pace.rode(8, 2 * target)
    assert size(0.009, 1) == 4 and work.pace.target_s == target  # the pace held is the first one
    assert size(0.009, 6) == 6  # a token per row at least
    work.pace.rode(4, target / 2)
    assert size(0.004, 1) == 8
    work.pace.rode(1, 5 * target)
    assert size(0.004, 1) == 1
    work.pace.rode(16, target / 4)
    assert size(0.004, 4) == 32 and size(0.004, 60) == 4


def test_a_speculating_batch_refuses_a_rider_and_the_scheduler_never_offers_one(long_model):
    """MTP steps take two tokens a row, which a rider's one-token rows cannot share: such a batch says it
    carries none, refuses one, and chunks run between its steps."""
    engine = Engine(long_model, speculative=True, eos_token_ids=frozenset())
    batch = engine.start([Request([5, 6, 7], 8, GREEDY)])
    work = ChunkedPrefill(engine, Request(PROMPT, 4, GREEDY), 16)
    assert not batch.carries_riders
    with pytest.raises(ValueError, match="cannot carry"):
        batch.step(work.rider(4))
    work.release()
    batch.release()
