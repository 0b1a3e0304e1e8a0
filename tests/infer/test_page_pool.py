"""The latent cache in pages of one pool: merges, drops and prefix hits move no cache bytes, a full pool
preempts and resumes rows with the tokens they would have had, waits new requests, and never fails with
out-of-memory; a request that cannot fit alone gets one clear error."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsv3.infer.engine import Engine, Request
from dsv3.infer.prefix_cache import PrefixCache
from dsv3.infer.sampling import GREEDY, SamplingParams
from dsv3.infer.server import create_app
from dsv3.model.transformer import Transformer
from dsv3.testing.http import serving

PAGE = 8


def pool_engine(model, pages: int | None = None, **kwargs) -> Engine:
    """An engine whose pool holds ``pages`` pages of PAGE tokens (None: the default budget)."""
    engine = Engine(model, eos_token_ids=frozenset(), page_tokens=PAGE, **kwargs)
    if pages is not None:
        engine = Engine(model, eos_token_ids=frozenset(), page_tokens=PAGE,
                        kv_cache_bytes=(pages + 1) * engine.pool.page_bytes, **kwargs)  # and the blank page
    return engine


def tokens_of(results) -> list[list[int]]:
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42], [7] * 20, [100, 101, 102, 103, 104, 105]]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_a_full_pool_preempts_and_resumes_rows_with_the_same_tokens(model, speculative):
    """Four requests of 11 + 24 tokens need 20 pages; a pool of 9 runs them a few at a time: rows are
    preempted as their contexts grow and prefilled again later, and every request's tokens (greedy, and
    sampled with a seed) are those of a pool with room for all."""
    for params in (GREEDY, SamplingParams(temperature=0.8, seed=3)):
        roomy = pool_engine(model, speculative=speculative)
        want = tokens_of(roomy.generate([Request(p, 24, params) for p in PROMPTS]))
        tight = pool_engine(model, 9, speculative=speculative)
        got = tokens_of(tight.generate([Request(p, 24, params) for p in PROMPTS]))
        assert got == want
        assert tight.last_stats.preemptions > 0
        assert tight.pool.free == tight.pool.pages  # every page given back


def test_a_preempted_row_resumes_as_soon_as_pages_free_up(model):
    """``Engine.stream`` (generate, chat) takes a preempted row back while the others still decode, once a
    finished row has given its pages back, not only after the whole batch has ended; its tokens are those of
    a pool with room for all."""
    prompts, lengths = [[5, 6, 7], [40, 41, 42], [7, 8, 9]], [30, 40, 40]
    want = tokens_of(pool_engine(model).generate([Request(p, n) for p, n in zip(prompts, lengths, strict=True)]))
    engine = pool_engine(model, 10)  # 80 slots: the newest row is preempted near 24 slots a row
    requests = [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]
    order = [requests.index(ev.request) for ev in engine.stream(requests) if ev.token_ids]
    assert engine.last_stats.preemptions > 0
    at = [i for i, r in enumerate(order) if r == 2]
    back = next(b for a, b in zip(at, at[1:], strict=False) if b - a > 3)  # row 2's first token after a pause
    assert 0 not in order[back:] and 1 in order[back + 1 :], order  # row 0 had ended, row 1 still decoded
    again = [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert tokens_of(pool_engine(model, 10).generate(again)) == want
    assert engine.pool.free == engine.pool.pages


def test_a_request_that_cannot_fit_alone_fails_with_one_clear_error(model):
    engine = pool_engine(model, 2)  # 16 slots
    result = engine.generate([Request(list(range(1, 12)), 30)])[0]
    assert result.finish_reason == "error" and "raise --kv-cache-bytes" in result.error
    assert "a context of 17 tokens does not fit" in result.error  # the 16 slots held and this step's one
    assert engine.pool.free == engine.pool.pages


def test_merges_drops_and_growth_move_no_cache_bytes(model, monkeypatch):
    """After prefill, a batch only remaps pages: no cache is allocated and no page is copied while rows
    join, grow and leave (each row's tokens still those it decodes alone)."""
    engine = pool_engine(model)
    alone = [tokens_of(engine.generate([Request(p, 12 + 3 * i)]))[0] for i, p in enumerate(PROMPTS)]
    batch = engine.start([Request(PROMPTS[0], 12)])
    got = {0: list(batch.first_events[0].token_ids)}
    monkeypatch.setattr(Transformer, "new_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    copies = []
    monkeypatch.setattr(engine.pool, "copy", lambda src, dst: copies.append(src))
    for i, prompt in enumerate(PROMPTS[1:], 1):
        pages_before = [list(p) for p in batch.pages]
        fresh = engine.start([Request(prompt, 12 + 3 * i)])
        got[i] = list(fresh.first_events[0].token_ids)
        batch.merge(fresh)
        assert batch.pages[: len(pages_before)] == pages_before  # the running rows' pages stay where they were
        for ev in batch.step():
            got[PROMPTS.index(ev.request.prompt_ids)] += ev.token_ids
    while batch.rows:
        for ev in batch.step():
            got[PROMPTS.index(ev.request.prompt_ids)] += ev.token_ids
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert copies == [] and engine.pool.free == engine.pool.pages


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_a_prefix_hit_maps_the_cached_pages(model, speculative):
    """The second request with a cached 3-block prefix heads its page table with the cache's own pages
    (with speculation, all but the last, which is its own copy) and decodes as without the cache."""
    prompt = list(range(1, 3 * PAGE + 4))
    plain = pool_engine(model, speculative=speculative)
    want = tokens_of(plain.generate([Request(prompt, 6)]))
    engine = pool_engine(model, speculative=speculative)
    cache = PrefixCache.for_engine(engine, 1 << 30, block_tokens=PAGE)
    engine.generate([Request(prompt, 6)])
    key, chain = cache.root, []
    for i in range(3):
        key = cache.hasher(key, tuple(prompt[i * PAGE : (i + 1) * PAGE]))
        chain.append(cache.blocks[key].page)
    request = Request(prompt, 6)
    batch = engine.start([request])
    assert request.cached_tokens == 3 * PAGE
    if speculative:
        assert batch.pages[0][:2] == chain[:2] and batch.pages[0][2] not in chain
    else:
        assert batch.pages[0][:3] == chain
    tokens = list(batch.first_events[0].token_ids)
    while batch.rows:
        tokens += [t for ev in batch.step() for t in ev.token_ids]
    assert [tokens] == want
    assert engine.pool.free == engine.pool.pages - len(cache.blocks)  # only the cache holds pages now


def test_the_server_lets_requests_wait_for_pages_and_answers_all(model, tokenizer):
    """Eight concurrent requests through the server on a pool that holds about three at a time, all queued
    before the first is taken in: each one answered, with the text it gets alone (those that do not fit
    wait for the pages of those prefilled just before them, they are not failed as if they never could)."""
    bodies = [{"prompt": p, "max_tokens": 20, "temperature": 0} for p in PROMPTS * 2]
    alone = pool_engine(model, tokenizer=tokenizer)
    want = [alone.generate([Request(b["prompt"], 20)])[0].text for b in bodies]
    engine = pool_engine(model, 12, tokenizer=tokenizer)
    app = create_app(engine, model_name="tiny", max_batch=8)
    scheduler = app.state.scheduler
    admit, all_queued = scheduler._admit, threading.Event()

    def admit_once_all_are_queued() -> None:  # together, their rows outgrow the pool: some wait preempted
        deadline = time.time() + 30
        while not all_queued.is_set() and scheduler.pending.qsize() < len(bodies) and time.time() < deadline:
            time.sleep(0.001)
        all_queued.set()
        admit()

    scheduler._admit = admit_once_all_are_queued
    with serving(app) as url, ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=120).json(), bodies))
        metrics = httpx.get(url + "/metrics").text
    assert [r["choices"][0]["text"] for r in replies] == want
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    assert engine.pool.free == engine.pool.pages
    preempted = next(line for line in metrics.splitlines() if line.startswith("dsv3_num_preemptions_total"))
    assert int(preempted.split()[-1]) > 0  # some waited as preempted rows, not only as new requests
