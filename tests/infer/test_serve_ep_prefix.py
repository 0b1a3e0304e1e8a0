"""The prefix cache under `serve --ep 4` and `--ep 4 --prefill-ranks 2` (four gloo processes, tiny model): a
second request with the same prefix is served from the cache of the rank that prefilled the first (the front
end routes by prefix), reports it in `usage.prompt_tokens_details.cached_tokens` and `/metrics`, and answers
exactly as one process does; the on-disk tier is shared by the ranks."""

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from prometheus_text import parse, total  # noqa: E402
from test_serve_ep import checkpoint, serve_group  # noqa: E402, F401 (a fixture)

from dsv3.infer.engine import Engine, Request  # noqa: E402

BLOCK = 4
PROMPT = [int(t) for t in torch.randint(3, 290, (101,), generator=torch.Generator().manual_seed(7))]
CACHED = (len(PROMPT) - 1) // BLOCK * BLOCK  # 100: every full block before the last token


@pytest.fixture(scope="module")
def reference(checkpoint):  # noqa: F811
    """One process's greedy completions of the first prompt and of the second (the first plus two tokens)."""
    import dsv3
    from dsv3.infer.loading import load_tokenizer

    engine = Engine(dsv3.load_pretrained(checkpoint), load_tokenizer(checkpoint))
    return [engine.generate([Request(PROMPT + tail, 6)])[0].text for tail in ([], [11, 12])]


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@contextmanager
def _rank_0_busy(url: str):
    """A long streamed request decoding on rank 0 (an idle group's least loaded rank) while the block runs;
    cancelled at its end (the client hangs up)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": [5, 6, 7], "max_tokens": 500, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the request
        next(lines)  # its first token: it is on rank 0
        yield


def _wait_idle(url: str) -> None:
    deadline = time.time() + 60
    while any(httpx.get(url + "/cluster", timeout=10).json()["in_flight"]):
        assert time.time() < deadline, "a cancelled request stayed in its rank's batch"
        time.sleep(0.1)


def _prefix_metrics(url: str, want_hits: int) -> dict:
    """The group's prefix-cache counters once they show ``want_hits`` (the ranks report them with the expert
    load, at a step boundary after a scrape asks)."""
    deadline = time.time() + 30
    while True:
        samples = parse(httpx.get(url + "/metrics", timeout=10).text)
        if total(samples, "dsv3_prefix_cache_hits_total") >= want_hits or time.time() > deadline:
            return samples
        time.sleep(0.2)


def _check_second_request_is_served_by_the_cache(url: str, reference: list[str], busy_rank_0: bool = False) -> dict:
    """``busy_rank_0``: the first request is sent while another occupies rank 0, so that it goes to rank 1;
    the second comes when all ranks are idle, when the least loaded rank would be rank 0 again: only routing
    by prefix sends it where its prefix is cached."""
    if busy_rank_0:
        with _rank_0_busy(url):
            first = _complete(url, PROMPT)
        _wait_idle(url)
    else:
        first = _complete(url, PROMPT)
    second = _complete(url, PROMPT + [11, 12])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= CACHED
    assert [r["choices"][0]["text"] for r in (first, second)] == reference
    samples = _prefix_metrics(url, CACHED)
    assert total(samples, "dsv3_prefix_cache_hits_total") >= CACHED
    assert total(samples, "dsv3_prompt_cached_tokens_total") >= CACHED
    return samples


def test_ep4_prefix_cache_routes_by_prefix_and_the_ranks_share_the_disk_tier(checkpoint, reference,  # noqa: F811
                                                                              tmp_path):
    """A budget of one byte sends every block of the 25-block chain to the folder. In the first group rank 1
    prefills the first request (rank 0 busy) and writes them; the second request goes to rank 1 by its prefix
    and reads them back. A group started later over the same folder serves the prompt from rank 0, which
    reads rank 1's blocks: the ranks name blocks by the group's fingerprint, not by their own experts."""
    folder = tmp_path / "blocks"
    flags = ("--prefix-cache-bytes", "1", "--prefix-block-tokens", str(BLOCK), "--prefix-cache-dir", str(folder))
    with serve_group(checkpoint, 4, *flags, torchrun=False) as group:
        samples = _check_second_request_is_served_by_the_cache(group.url, reference, busy_rank_0=True)
        assert httpx.get(group.url + "/cluster").json()["assigned"] == [1, 2, 0, 0]
        assert total(samples, "dsv3_prefix_cache_disk_writes_total") == 25
        assert total(samples, "dsv3_prefix_cache_disk_reads_total") == 25
        assert total(samples, "dsv3_prefix_cache_capacity_bytes") == 4  # four ranks' budgets
    assert len(list(folder.glob("*.blk"))) == 25
    with serve_group(checkpoint, 4, *flags, torchrun=False) as group:
        again = _complete(group.url, PROMPT + [11, 12])
        assert httpx.get(group.url + "/cluster").json()["assigned"] == [1, 0, 0, 0]
        samples = _prefix_metrics(group.url, CACHED)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
    assert again["choices"][0]["text"] == reference[1]
    assert total(samples, "dsv3_prefix_cache_disk_reads_total") == 25
    assert total(samples, "dsv3_prefix_cache_disk_rejected_total") == 0


def test_ep4_prefill_ranks_2_prefix_cache_serves_the_second_request(checkpoint, reference):  # noqa: F811
    with serve_group(checkpoint, 4, "--prefill-ranks", "2", "--prefix-block-tokens", str(BLOCK)) as group:
        samples = _check_second_request_is_served_by_the_cache(group.url, reference)
        state = httpx.get(group.url + "/cluster").json()
    assert sum(state["assigned"][:2]) == 2 and sum(state["assigned"][2:]) == 2
    assert max(state["assigned"][:2]) == 2  # both went to the prefill rank that holds the prefix
    assert total(samples, "dsv3_prefix_cache_capacity_bytes") == 2 * 1e9  # two prefill ranks of 1G each
    assert state["kv_tokens_moved"] == 2 * len(PROMPT) + 2  # the cached prefix moves like any other cache


def test_prefix_affinity_picks_the_least_loaded_rank_holding_the_longest_prefix():
    from dsv3.infer.cluster.affinity import PrefixAffinity

    route = PrefixAffinity(block_tokens=2)
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9]
    assert route.choose(a, [0, 1, 2], [3, 0, 1]) == 1  # nothing known: the least loaded
    assert route.choose(b, [0, 1, 2], [0, 5, 5]) == 1  # its first 2 blocks are a's, on rank 1, however loaded
    assert route.choose(b, [0, 2], [0, 5, 5]) == 0  # rank 1 has no room: the least loaded of the others
    assert route.choose(a, [0, 1, 2], [0, 9, 0]) == 1  # ranks 0 and 1 hold 2 of a's blocks, rank 1 all 3
    assert route.choose(a, [0, 2], [0, 9, 0]) == 0  # rank 1 has no room: rank 0 holds a's first 2 blocks
    assert route.choose([1, 2, 3, 4], [0, 1, 2], [4, 2, 0]) == 1  # ranks 0 and 1 hold its block: 1 is less loaded
    assert route.choose([8], [0, 1, 2], [1, 1, 0]) == 2  # too short for a block: the least loaded
