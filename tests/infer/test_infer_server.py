"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server on
127.0.0.1 (a free port, in a thread, stopped at the end)."""

import socket
import threading
import time

import httpx
import pytest

from dsv3.infer.engine import Engine
from dsv3.infer.server import create_app

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer)
    app = create_app(engine, model_name="tiny", max_batch=4)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app, engine
    srv.should_exit = True
    thread.join(timeout=20)


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
