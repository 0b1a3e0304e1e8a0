"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server on
127.0.0.1 (a free port, in a thread, stopped at the end)."""

import copy
import dataclasses
import json
import re
import threading
import time

import httpx
import pytest
import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.server import create_app
from dsv3.testing.http import serving

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")




@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer)
    log: list[str] = []
    app = create_app(engine, model_name="tiny", max_batch=4, access_log=log.append)
    app.state.log = log
    with serving(app) as url:
        yield url, app, engine


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def expected_reply(engine, tokenizer, messages, max_tokens):
    from dsv3.infer.chat_template import render, stop_strings
    from dsv3.infer.engine import Request
    from dsv3.infer.sampling import GREEDY

    ids = tokenizer.encode(render(messages, tokenizer)).ids
    return engine.generate([Request(ids, max_tokens, GREEDY, stop_strings=stop_strings(tokenizer))])[0]


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_plain_and_streamed(client, server, tokenizer):
    messages = [{"role": "user", "content": "hello cat"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    want = expected_reply(server[2], tokenizer, messages, 12)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == want.finish_reason
    assert reply.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert sum(1 for c in chunks if c.choices[0].delta.content) > 1  # it really streamed


def test_completions_with_text_and_token_ids(client, server, tokenizer):
    from dsv3.infer.engine import Request

    ids = tokenizer.encode("the dog").ids
    want = server[2].generate([Request(ids, 8)])[0]
    by_text = client.completions.create(model="tiny", prompt="the dog", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == want.text


def test_bad_requests_get_4xx_json_errors(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert err.value.status_code == 400 and "messages" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    bad = httpx.post(server[0] + "/v1/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    too_long = httpx.post(server[0] + "/v1/completions", json={"prompt": [1] * 2000, "max_tokens": 4}, timeout=10)
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]


def test_concurrent_requests_are_batched_and_disconnect_frees_the_slot(client, server):
    from dsv3.infer.engine import Request

    scheduler = server[1].state.scheduler
    results = [None] * 3

    def ask(i):
        results[i] = client.completions.create(model="tiny", prompt=[3 + i, 4, 5], max_tokens=40, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, scheduler.active)
        time.sleep(0.002)
    assert peak >= 2  # requests were decoded together
    alone = [server[2].generate([Request([3 + i, 4, 5], 40)])[0].text for i in range(3)]
    assert [r.choices[0].text for r in results] == alone
    with httpx.stream("POST", server[0] + "/v1/completions", timeout=30,
                      json={"prompt": [7, 8, 9], "max_tokens": 1000, "stream": True, "temperature": 0}) as r:
        deadline = time.time() + 10
        while not scheduler.active and time.time() < deadline:  # admitted: its row is in the batch
            time.sleep(0.001)
        row = scheduler.batch.rows[0]
        assert r.status_code == 200
    # the client went away long before 1000 tokens: its request is cancelled and its row leaves the batch
    deadline = time.time() + 10
    while scheduler.active and time.time() < deadline:
        time.sleep(0.02)
    assert row.finish_reason == "cancelled" and scheduler.active == 0


def test_a_reply_not_streamed_is_cancelled_when_its_client_goes_away(server, monkeypatch):
    """Nothing reads the connection of a reply that is not streamed until it is sent: the server looks at it
    every ``DISCONNECT_POLL_S`` (shortened here) and cancels the request once the client has gone."""
    from dsv3.infer import server as serving_module

    monkeypatch.setattr(serving_module, "DISCONNECT_POLL_S", 0.005)
    scheduler = server[1].state.scheduler
    rows = []

    def note_rows():
        while not rows and scheduler.batch is None:
            time.sleep(0.0005)
        rows.extend(scheduler.batch.rows)

    watcher = threading.Thread(target=note_rows)
    watcher.start()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v1/completions", timeout=0.05,
                   json={"prompt": [7, 8, 9], "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
    watcher.join(timeout=10)
    deadline = time.time() + 10
    while scheduler.active and time.time() < deadline:
        time.sleep(0.005)
    assert rows and rows[0].finish_reason == "cancelled" and len(rows[0].generated) < 1000


# ---- one request never harms another -----------------------------------------------------------

def _concurrently(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[httpx.Response]:
    """POST every body at once (a barrier lines the threads up) and return the responses in order."""
    responses: list[httpx.Response | None] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def post(i):
        barrier.wait(timeout=10)
        responses[i] = httpx.post(url + path, json=bodies[i], timeout=60)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert all(r is not None for r in responses), "a request hung"
    return responses


def _alone_text(engine, prompt: list[int], n: int) -> str:
    from dsv3.infer.engine import Request

    return engine.generate([Request(prompt, n)])[0].text


def test_a_bad_seed_among_six_concurrent_requests_harms_no_one(server):
    """`"seed": 2**70` overflowed torch's generator when the batch started: 2-5 of the others got 500."""
    url, _, engine = server
    prompts = [[3 + i, 4, 5, 6, 7][: 2 + i % 3] for i in range(6)]
    bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0, "seed": i} for i, p in enumerate(prompts)]
    bodies[2]["seed"] = 2**70
    responses = _concurrently(url, bodies)
    assert responses[2].status_code == 400 and responses[2].json()["error"]["param"] == "seed"
    for i in (0, 1, 3, 4, 5):
        assert responses[i].status_code == 200
        assert responses[i].json()["choices"][0]["text"] == _alone_text(engine, prompts[i], 10)


def test_non_finite_logits_end_only_the_request_that_has_them(model, tokenizer):
    """A NaN in the weights (set in memory, as load-time checks would refuse it): greedy emitted token 0
    silently, sampling failed the whole batch with 500."""
    goods = [[5, 6, 7], [11, 12], [40, 41, 42, 43], [9, 8], [100, 101, 102]]
    reference = Engine(model, tokenizer)
    used = {t for p in goods for t in p + reference.generate([Request(p, 10)])[0].token_ids}
    broken = next(t for t in range(299, 0, -1) if t not in used)
    sick = copy.deepcopy(model)
    with torch.no_grad():
        sick.model.embed_tokens.weight[broken] = float("nan")
    app = create_app(Engine(sick, tokenizer), model_name="sick", max_batch=8)
    with serving(app) as url:
        bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in goods]
        bodies.append({"prompt": [broken, 5], "max_tokens": 10, "temperature": 0})
        bodies.append({"prompt": [7, broken], "max_tokens": 10, "temperature": 1.0, "seed": 1})
        streamed: list[str] = []
        thread = threading.Thread(target=lambda: streamed.extend(_sse_lines(url, {
            "prompt": [broken], "max_tokens": 10, "stream": True})))
        thread.start()
        responses = _concurrently(url, bodies)
        thread.join(timeout=60)
    for p, r in zip(goods, responses, strict=False):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _alone_text(reference, p, 10)
    for r in responses[-2:]:
        assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"]
    events = [json.loads(line) for line in streamed if line != "[DONE]"]
    assert streamed[-1] == "[DONE]" and "non-finite" in events[-1]["error"]["message"]
    assert not any(c["choices"][0]["text"] for c in events[:-1])  # no token was made up


def _sse_lines(url: str, body: dict, path: str = "/v1/completions") -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_config_without_max_position_embeddings_gives_400_not_500(model, tokenizer):
    unbounded = copy.copy(model)  # the same weights; only the config differs
    unbounded.config = dataclasses.replace(model.config, max_position_embeddings=None)
    with serving(create_app(Engine(unbounded, tokenizer), model_name="u")) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "max_position_embeddings" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.5"), ("top_p", 1.5), ("top_k", 2.5), ("max_tokens", True), ("max_tokens", 0),
    ("stop", 5), ("stop", ["x"] * 17), ("stop", "y" * 513), ("seed", -1), ("seed", 2**64), ("stream", "yes"),
    ("logprobs", 21),
])
def test_every_field_is_checked_before_admission(server, field, value):
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, field: value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["message"].startswith(field)


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("best_of", 2), ("min_p", 0.1),
])
def test_unsupported_fields_are_refused_by_name(server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    neutral = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 1, "user": "me",
               "presence_penalty": 0, "tools": []}
    assert httpx.post(server[0] + "/v1/chat/completions", json=neutral, timeout=30).status_code == 200


def test_content_as_an_array_of_text_parts(client, server, tokenizer):
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "cat"}]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                           max_tokens=8, temperature=0)
    want = expected_reply(server[2], tokenizer, [{"role": "user", "content": "hello cat"}], 8)
    assert reply.choices[0].message.content == want.text
    image = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": image}])
    assert "image_url" in err.value.body["message"] and err.value.body["param"] == "messages.0.content.1.type"


def test_completion_logprobs_match_a_direct_forward(server, model, tokenizer):
    ids = tokenizer.encode("the dog").ids
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    got = httpx.post(server[0] + "/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    generated = server[2].generate([Request(ids, 6)])[0].token_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids + generated]))[0, len(ids) - 1 : -1].log_softmax(-1)
    assert got["token_logprobs"] == pytest.approx([float(ref[j, t]) for j, t in enumerate(generated)], abs=1e-4)
    assert got["tokens"] == [tokenizer.decode([t]) for t in generated]
    for j, top in enumerate(got["top_logprobs"]):  # keyed by text: two tokens with one text share a key
        best = ref[j].topk(2).values.tolist()
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
    streamed = _sse_lines(server[0], {**body, "stream": True})
    chunks = [json.loads(line)["choices"][0]["logprobs"] for line in streamed[:-1]]
    assert sum((c["token_logprobs"] for c in chunks), []) == pytest.approx(got["token_logprobs"], abs=1e-6)


def test_chat_logprobs_through_the_openai_client(client, server, model, tokenizer):
    from dsv3.infer.chat_template import render

    messages = [{"role": "user", "content": "hello cat"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    prompt = tokenizer.encode(render(messages, tokenizer)).ids
    want = expected_reply(server[2], tokenizer, messages, 5).token_ids
    with torch.no_grad():
        ref = model(torch.tensor([prompt + want]))[0, len(prompt) - 1 : -1].log_softmax(-1)
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([float(ref[j, t]) for j, t in enumerate(want)], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    text = bytes(b for c in content for b in c.bytes).decode("utf-8", "replace")  # bytes are exact, pieces not
    assert text == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # top_logprobs without logprobs
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)


def test_access_log_has_one_line_per_request(server):
    """One line per request, in order. Lines of earlier tests' requests that end late (a client that hung
    up mid-stream is logged when the server notices) may interleave, so only this test's paths count."""
    url, app, _ = server
    before = len(app.state.log)
    httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "temperature": 0}, timeout=30)
    httpx.get(url + "/v1/models", timeout=30)
    _sse_lines(url, {"prompt": [1, 2], "max_tokens": 4, "stream": True})
    ours = ('"POST /v1/completions" 200 3 tokens', '"GET /v1/models" 200', '"POST /v1/completions" 200 4 tokens')

    def logged() -> list[str]:
        return [line for line in app.state.log[before:] if any(mark in line for mark in ours)]

    deadline = time.time() + 5
    while len(logged()) < 3 and time.time() < deadline:
        time.sleep(0.01)
    lines = logged()
    assert len(lines) == 3, app.state.log[before:]
    assert ours[0] in lines[0] and lines[0].endswith(" ms") and lines[0].startswith("127.0.0.1:")
    assert re.search(r'"GET /v1/models" 200 \d+ ms$', lines[1])
    assert ours[2] in lines[2]


# ---- /metrics, usage details, ignore_eos ------------------------------------------------------------

def test_metrics_count_requests_tokens_and_each_experts_load(server, model):
    """Expert load: every token a forward feeds is routed to top-k experts of each MoE layer it passes,
    so a request of P prompt and G generated tokens (no speculation) adds k * (P + G - 1) per layer."""
    from .prometheus_text import parse, total

    url = server[0]
    before = parse(httpx.get(url + "/metrics", timeout=10).text)
    reply = httpx.post(url + "/v1/completions", json={"prompt": [4, 5, 6, 7], "max_tokens": 5, "temperature": 0},
                       timeout=30).json()
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # this server has no prefix cache
    after = parse(httpx.get(url + "/metrics", timeout=10).text)
    assert not any(name.startswith("dsv3_prefix_cache") for name, _ in after)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    generated = reply["usage"]["completion_tokens"]
    assert delta("dsv3_requests_total") == delta("dsv3_requests_total", finish_reason=reply["choices"][0][
        "finish_reason"]) == 1
    assert delta("dsv3_prompt_tokens_total") == 4 and delta("dsv3_generation_tokens_total") == generated
    assert delta("dsv3_time_to_first_token_seconds_count") == 1
    assert delta("dsv3_request_latency_seconds_count") == 1
    assert delta("dsv3_request_queue_time_seconds_count") == 1
    assert delta("dsv3_spec_decode_draft_tokens_total") == delta("dsv3_spec_decode_accepted_tokens_total") == 0
    k, fed = model.config.num_experts_per_tok, 4 + generated - 1
    n_main = sum(1 for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i))
    per_layer = [delta("dsv3_expert_tokens_total", rank=0, layer=i) for i in range(len(model.moe_layers()))]
    assert per_layer[:n_main] == [k * fed] * n_main and not any(per_layer[n_main:])  # the MTP layer is idle
    assert delta("dsv3_rank_expert_tokens_total", rank=0) == k * fed * n_main


def test_metrics_keep_the_fast_decode_path_and_count_what_the_module_path_routes(tokenizer, monkeypatch):
    """/metrics counts expert load where a decode step routes, not with forward hooks (a hooked MoE block
    runs through its modules, several times slower): while serving, every decode step is one call of the C
    step kernel (whose block kernels add the experts they choose to the counters), and the per-expert loads
    /metrics reports equal what the module path's routers choose for the same request (a copy of the model,
    counted by hooks, generating through its modules)."""
    from dsv3.kernels import decode_kernels as dk

    from .conftest import tiny_model
    from .prometheus_text import parse

    model = tiny_model(seed=3)
    reference = copy.deepcopy(model)
    steps = []
    real = dk.decode_step
    monkeypatch.setattr(dk, "decode_step", lambda *args: (steps.append(1), real(*args))[1])
    prompt, new = [5, 6, 7, 8, 9], 6
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    with serving(create_app(Engine(model, tokenizer), model_name="tiny")) as url:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        samples = parse(httpx.get(url + "/metrics", timeout=10).text)
    if dk.kernels_available():
        assert len(steps) == new - 1
    served = {(int(dict(labels)["layer"]), int(dict(labels)["expert"])): value
              for (name, labels), value in samples.items() if name == "dsv3_expert_tokens_total"}

    routed = [torch.zeros(moe.n_experts, dtype=torch.long) for moe in reference.moe_layers()]

    def counter(counts):
        def hook(_module, _inputs, out) -> None:
            counts.add_(torch.bincount(out[0].flatten(), minlength=counts.numel()))
        return hook

    for counts, moe in zip(routed, reference.moe_layers(), strict=True):
        moe.gate.register_forward_hook(counter(counts))
    want = Engine(reference, tokenizer, fast=False).generate([Request(prompt, new, ignore_eos=True)])[0]
    assert reply["choices"][0]["text"] == want.text
    assert served == {(layer, e): n for layer, c in enumerate(routed) for e, n in enumerate(c.tolist())}
    n_moe = sum(1 for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i))
    assert sum(served.values()) == model.config.num_experts_per_tok * (len(prompt) + new - 1) * n_moe


def test_expert_counts_fold_every_call_once_while_read_from_another_thread():
    """``ExpertCounts`` keeps each call's chosen experts and adds them up in batches (every FOLD calls, and
    on each read): a reader thread scraping all along never sees a count go down, and the final counts are
    the bincount of everything given, each call once."""
    from dsv3.infer.metrics import ExpertCounts

    counts = ExpertCounts(8, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    given = [torch.randint(0, 8, (3, 2), generator=generator) for _ in range(3 * ExpertCounts.FOLD + 5)]
    seen, done = [], threading.Event()

    def scrape() -> None:
        while not done.is_set():
            seen.append(counts.tolist())

    reader = threading.Thread(target=scrape)
    reader.start()
    for idx in given:
        counts(idx)
    done.set()
    reader.join()
    assert counts.tolist() == torch.bincount(torch.cat(given).flatten(), minlength=8).tolist()
    assert all(a <= b for before, after in zip(seen, seen[1:], strict=False)
               for a, b in zip(before, after, strict=True))


def test_model_card_reports_context_and_vocabulary(server, model):
    card = httpx.get(server[0] + "/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == model.config.max_position_embeddings
    assert card["vocab_size"] == model.config.vocab_size


def test_ignore_eos_generates_exactly_max_tokens(model, tokenizer):
    """With the first greedy token as end-of-text, a request stops at once, unless it asks ignore_eos."""
    first = Engine(model, tokenizer).generate([Request([9, 10, 11], 1)])[0].token_ids[0]
    app = create_app(Engine(model, tokenizer, eos_token_ids=frozenset({first})), model_name="tiny")
    with serving(app) as url:
        body = {"prompt": [9, 10, 11], "max_tokens": 6, "temperature": 0}
        stopped = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
        full = httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=30).json()
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 6
        bad = httpx.post(url + "/v1/completions", json={**body, "ignore_eos": "yes"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_a_malformed_body_gets_one_plain_message(server):
    """Before: '1: JSON decode error' with param '1', and 'Input should be a valid dictionary' for a body sent
    without its Content-Type."""
    url = server[0] + "/v1/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    error = bad_json.json()["error"]
    assert bad_json.status_code == 400 and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON at character 1")
    no_type = httpx.post(url, content=json.dumps({"prompt": "hi"}).encode(), timeout=10)
    assert no_type.status_code == 400
    assert no_type.json()["error"]["message"] == ("send the body as a JSON object with 'Content-Type: "
                                                  "application/json' (the request has no Content-Type)")
    text = httpx.post(url, content=b"hi", headers={"content-type": "text/plain"}, timeout=10)
    assert "got Content-Type 'text/plain'" in text.json()["error"]["message"]
    a_list = httpx.post(url, json=[1, 2], timeout=10)
    assert a_list.json()["error"]["message"] == "the request body must be a JSON object (with the request's " \
                                                "fields), not list"


def test_an_api_key_guards_the_v1_routes_with_openai_s_401(model, tokenizer):
    app = create_app(Engine(model, tokenizer), model_name="tiny", api_key="sesame")
    with serving(app) as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401  # no key at all
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes and scrapes stay open
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200


def test_bad_prefix_cache_flags_with_ep_are_one_error_line_before_any_process_group(capsys):
    """`serve --ep N` takes the prefix-cache flags (tests/infer/test_serve_ep_prefix.py); a wrong value is
    one error line naming the flag, found before the ranks start waiting for each other."""
    from dsv3.cli import main

    assert main(["serve", "--model", "no-such-model", "--ep", "2", "--prefix-cache-bytes", "512Q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --prefix-cache-bytes")
    assert main(["serve", "--model", "x", "--ep", "2", "--prefix-cache-bytes", "0", "--prefix-cache-dir", "d"]) == 2
    assert capsys.readouterr().err.startswith("error: --prefix-cache-dir needs a prefix cache")


def test_metrics_report_mtp_acceptance_as_the_engine_counts_it(model, tokenizer):
    """With MTP speculation, /metrics counts the draft tokens each decode step verified and how many it
    accepted: the same numbers the engine's own counters give for the same greedy request."""
    from .prometheus_text import parse, total

    prompt = [4, 5, 6, 7]
    direct = Engine(model, tokenizer, speculative=True)
    direct.generate([Request(prompt, 12, ignore_eos=True)])
    expected = direct.last_stats
    app = create_app(Engine(model, tokenizer, speculative=True), model_name="tiny")
    with serving(app) as url:
        httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60).raise_for_status()
        scraped = parse(httpx.get(url + "/metrics", timeout=10).text)
    drafted = total(scraped, "dsv3_spec_decode_draft_tokens_total")
    accepted = total(scraped, "dsv3_spec_decode_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert total(scraped, "dsv3_generation_tokens_total") == 12
    assert (drafted, accepted) == (expected.drafted, expected.accepted)


def test_serve_runs_the_decode_loop_on_the_main_thread(model, tokenizer, monkeypatch):
    """`dsv3 serve` steps its batch on the main thread with uvicorn beside it (``Scheduler.drive`` says why:
    on another thread libgomp's threads slept at every barrier, a third of the engine's speed at 2 threads);
    a request is answered, and SIGTERM stops the server and the loop with it."""
    import os
    import signal

    from dsv3.infer.cli import listen, run_beside
    from dsv3.infer.engine import Batch

    on_main, real_step = set(), Batch.step

    def step(self, rider=None, **kw):
        on_main.add(threading.current_thread() is threading.main_thread())
        return real_step(self, rider, **kw)

    monkeypatch.setattr(Batch, "step", step)
    app = create_app(Engine(model, tokenizer), model_name="tiny")
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    answers = []

    def client():
        try:
            deadline = time.time() + 20
            while not server.started and time.time() < deadline:
                time.sleep(0.02)
            r = httpx.post(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", timeout=30,
                           json={"prompt": "the cat", "max_tokens": 4, "temperature": 0})
            answers.append(r.status_code)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=client, daemon=True).start()
    run_beside(server, sock, app.state.scheduler)
    assert answers == [200] and on_main == {True}
