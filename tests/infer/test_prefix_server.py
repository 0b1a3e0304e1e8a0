"""The prefix cache behind the HTTP server: cached tokens in usage, time to first token, /metrics."""

import random
import time

import httpx
import pytest

from dsv3.infer.engine import Engine, Request
from dsv3.infer.prefix_cache import PrefixCache
from dsv3.infer.sampling import GREEDY
from dsv3.infer.server import create_app
from dsv3.testing.http import serving

from .prometheus_text import parse, total, value

openai = pytest.importorskip("openai")

PREFIX = 1000


@pytest.fixture(scope="module")
def cached_server(long_model, tokenizer):
    engine = Engine(long_model, tokenizer, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(engine, 1 << 30)
    app = create_app(engine, model_name="tiny", max_batch=4)
    with serving(app) as url:
        yield url, cache


def stream_ttft(client, prompt: list[int], max_tokens: int = 4) -> tuple[float, list[str], dict]:
    """Time to the first streamed chunk, the texts, and the final usage."""
    t0 = time.perf_counter()
    first, texts, usage = None, [], None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            first = first or time.perf_counter()
            texts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    return first - t0, texts, usage


def test_a_shared_1000_token_prefix_is_reused_and_cuts_the_time_to_first_token(cached_server, long_model, tokenizer):
    url, cache = cached_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(0)
    prefix = [rng.randrange(300) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(300) for _ in range(8)] for _ in range(3)]
    plain = Engine(long_model, tokenizer, eos_token_ids=frozenset())
    ttft_first, texts, usage = stream_ttft(client, prompts[0])
    assert usage.prompt_tokens == PREFIX + 8 and usage.prompt_tokens_details.cached_tokens == 0
    later = []
    for prompt in prompts[1:]:
        ttft, texts, usage = stream_ttft(client, prompt)
        assert usage.prompt_tokens_details.cached_tokens == PREFIX // 16 * 16
        assert "".join(texts) == plain.generate([Request(prompt, 4, GREEDY)])[0].text
        later.append(ttft)
    assert min(later) <= ttft_first / 3, (ttft_first, later)

    reply = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == (PREFIX + 7) // 16 * 16  # its own blocks too
    assert reply.choices[0].text == plain.generate([Request(prompts[1], 6, GREEDY)])[0].text


def test_metrics_report_the_prefix_cache_and_the_requests(cached_server):
    url, cache = cached_server
    before = parse(httpx.get(url + "/metrics", timeout=10).text)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [5] * 40
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = parse(response.text)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("dsv3_requests_total", finish_reason="length") == 2
    assert delta("dsv3_prompt_tokens_total") == 80
    assert delta("dsv3_generation_tokens_total") == 6
    assert delta("dsv3_prompt_cached_tokens_total") == 32  # the second reuses 2 blocks of 16
    assert delta("dsv3_prefix_cache_queries_total") == 80
    assert delta("dsv3_prefix_cache_hits_total") == 32
    assert value(after, "dsv3_prefix_cache_hits_total") == cache.counters.hits
    assert value(after, "dsv3_prefix_cache_blocks") == len(cache.blocks) > 0
    assert value(after, "dsv3_prefix_cache_bytes") == cache.used_bytes
    assert value(after, "dsv3_prefix_cache_capacity_bytes") == 1 << 30
    assert delta("dsv3_time_to_first_token_seconds_count") == 2
    assert delta("dsv3_time_per_output_token_seconds_count") == 2
    assert delta("dsv3_batch_size_count") >= 2  # two decode steps each, at least
    assert value(after, "dsv3_requests_running") == 0 and value(after, "dsv3_requests_waiting") == 0
