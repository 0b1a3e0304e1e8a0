"""Sampling parameters through the server: n choices with per-choice seeds, the penalties, logit_bias and
min_tokens, checked against a direct forward of the model with each definition applied by hand."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import SamplingParams
from dsv3.infer.server import create_app
from dsv3.testing.http import serving

from .conftest import tiny_model

PENALTIES = {"presence_penalty": 0.7, "frequency_penalty": 0.9, "repetition_penalty": 1.6,
             "logit_bias": {"5": 3.0, "17": -2.5, "40": 1.5}}


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer)
    app = create_app(engine, model_name="tiny", max_batch=8)
    with serving(app) as url:
        yield url, engine, app.state.scheduler


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _by_hand(logits: torch.Tensor, prompt: list[int], generated: list[int], presence: float, frequency: float,
             repetition: float, bias: dict[int, float]) -> torch.Tensor:
    """The definitions, written out token by token: OpenAI's logit_bias, vLLM's repetition penalty over
    the prompt and the output, OpenAI's frequency and presence penalties over the output."""
    out = logits.double().clone()
    for tok, b in bias.items():
        out[tok] += b
    for tok in set(prompt) | set(generated):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(generated):
        out[tok] -= generated.count(tok) * frequency + presence
    return out.log_softmax(-1)


def _check_against_forward(model, prompt: list[int], got: dict, params: dict) -> list[int]:
    """Every returned logprob (the chosen token's and the best 20) equals the hand-made distribution's at
    that step; greedy picks its argmax. Returns the generated ids."""
    bias = {int(k): v for k, v in params.get("logit_bias", {}).items()}
    generated: list[int] = []
    for step, (lp, top) in enumerate(zip(got["token_logprobs"], got["top_logprobs"], strict=True)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated]))[0, -1]
        ref = _by_hand(logits, prompt, generated, params.get("presence_penalty", 0),
                       params.get("frequency_penalty", 0), params.get("repetition_penalty", 1), bias)
        token = int(ref.argmax())
        assert lp == pytest.approx(float(ref[token]), abs=1e-4), f"step {step}"
        best = ref.topk(20).values.tolist()
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
        generated.append(token)
    return generated


def test_penalties_and_logit_bias_give_the_distribution_their_definitions_give(server, model):
    prompt = [5, 6, 7, 5, 6, 7, 40]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 20, "ignore_eos": True}
    got = _post(server[0], {**body, **PENALTIES}).json()["choices"][0]["logprobs"]
    penalised = _check_against_forward(model, prompt, got, PENALTIES)
    plain = _post(server[0], body).json()["choices"][0]["logprobs"]
    assert _check_against_forward(model, prompt, plain, {}) != penalised  # they do change the output here
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):  # each one alone
        alone = {name: PENALTIES[name]}
        _check_against_forward(model, prompt, _post(server[0], {**body, **alone}).json()["choices"][0]["logprobs"],
                               alone)


def test_chat_takes_the_same_parameters_streamed_and_not(server, tokenizer):
    body = {"messages": [{"role": "user", "content": "hello cat"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, **PENALTIES}
    whole = _post(server[0], body, "/v1/chat/completions").json()["choices"][0]
    lines = _sse(server[0], {**body, "stream": True}, "/v1/chat/completions")
    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
    streamed = [e["logprob"] for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == pytest.approx([e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-6)


def _sse(url: str, body: dict, path: str = "/v1/completions") -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return lines[:-1]


def test_n_choices_repeat_with_the_same_seed_and_differ_from_each_other(server):
    body = {"prompt": [3, 4, 5], "max_tokens": 10, "temperature": 1.5, "n": 4, "seed": 1234, "ignore_eos": True}
    first, again = (_post(server[0], body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1  # each choice samples from its own stream
    assert first["usage"]["prompt_tokens"] == 3 and first["usage"]["completion_tokens"] == 40
    one = _post(server[0], {**body, "n": 1}).json()["choices"][0]["text"]
    assert one == texts[0]  # choice 0 keeps the seed: n = 1 samples as before
    other = _post(server[0], {**body, "seed": 99}).json()["choices"]
    assert [c["text"] for c in other] != texts
    streamed = _sse(server[0], {**body, "stream": True})
    parts = {i: "" for i in range(4)}
    for line in streamed:
        choice = json.loads(line)["choices"][0]
        parts[choice["index"]] += choice["text"]
    assert [parts[i] for i in range(4)] == texts


def test_in_a_batch_each_request_gets_what_it_gets_alone(server):
    """A penalised greedy request, a plain greedy one and four seeded choices, sent at once (decoded together):
    each answer equals the same body's answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": [5, 6, 7, 5, 6], "max_tokens": 60, "temperature": 0, "ignore_eos": True, **PENALTIES},
              {"prompt": [9, 10], "max_tokens": 70, "temperature": 0, "ignore_eos": True},
              {"prompt": [3, 4, 5], "max_tokens": 50, "temperature": 1.5, "n": 4, "seed": 5, "ignore_eos": True,
               "min_tokens": 3, "presence_penalty": 1.0}]

    def texts(body: dict) -> list[str]:
        return [c["text"] for c in _post(server[0], body).json()["choices"]]

    alone = [texts(b) for b in bodies]
    scheduler, peak = server[2], 0
    with ThreadPoolExecutor(len(bodies)) as pool:
        jobs = [pool.submit(texts, b) for b in bodies]
        while not all(j.done() for j in jobs):
            peak = max(peak, scheduler.active)
            time.sleep(0.001)
    assert [j.result() for j in jobs] == alone
    assert peak >= 3  # decoded together


def test_choices_of_one_prompt_share_its_prefill(model, tokenizer):
    """Four rows with one prompt: the prefill runs the model over one row, and every row decodes as the
    prompt decodes alone."""
    rows_per_prefill = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda _, args: rows_per_prefill.append(args[0].shape[0]) if args[0].shape[1] > 1 else None)
    try:
        engine = Engine(model, tokenizer)
        together = engine.generate([Request([9, 8, 7, 6], 6) for _ in range(4)])
        assert rows_per_prefill == [1]
        alone = engine.generate([Request([9, 8, 7, 6], 6)])[0]
        mixed = engine.generate([Request([9, 8, 7, 6], 6), Request([1, 2], 6), Request([9, 8, 7, 6], 6)])
    finally:
        hook.remove()
    assert rows_per_prefill == [1, 1, 2]
    assert all(r.token_ids == alone.token_ids for r in together)
    assert mixed[0].token_ids == mixed[2].token_ids == alone.token_ids
    assert mixed[1].token_ids == engine.generate([Request([1, 2], 6)])[0].token_ids


def test_shared_prefill_with_mtp_and_the_prefix_cache_decodes_each_row_as_alone(tokenizer):
    """With speculation (each row then drafts from its own first token) and a prefix cache (which stores the
    shared prompt once): three rows of one prompt and one other, greedy, each equal to its prompt alone."""
    from dsv3.infer.prefix_cache import PrefixCache

    model = tiny_model(vocab=12, gain=3.0)
    prompt, other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4, 5]
    engine = Engine(model, speculative=True)
    PrefixCache.for_engine(engine, 1 << 20, block_tokens=4)
    together = engine.generate([Request(prompt, 20), Request(other, 20), Request(prompt, 20), Request(prompt, 20)])
    alone = Engine(model, speculative=True).generate([Request(prompt, 20)])[0].token_ids
    assert [r.token_ids for r in together] == [alone, Engine(model).generate([Request(other, 20)])[0].token_ids,
                                               alone, alone]
    assert len(engine.prefix_cache.blocks) == 2  # the prompt's 2 usable blocks, stored once


def test_min_tokens_holds_back_end_of_sequence_until_reached(model, tokenizer):
    """With the first greedy token as end-of-sequence a request stops at once; min_tokens 4 makes it
    draw the best other token instead, until 4 tokens are out."""
    prompt = [9, 10, 11]
    eos = Engine(model, tokenizer).generate([Request(prompt, 1)])[0].token_ids[0]
    engine = Engine(model, tokenizer, eos_token_ids=frozenset({eos}))
    with serving(create_app(engine, model_name="tiny")) as url:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
        assert _post(url, body).json()["usage"]["completion_tokens"] == 1
        held = _post(url, {**body, "min_tokens": 4}).json()
    tokens = engine.generate([Request(prompt, 12, SamplingParams(temperature=0, min_tokens=4))])[0].token_ids
    assert eos not in tokens[:4] and held["usage"]["completion_tokens"] == len(tokens) >= 4
    with torch.no_grad():
        first = model(torch.tensor([prompt]))[0, -1].clone()
    first[eos] = float("-inf")
    assert tokens[0] == int(first.argmax())
    assert held["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(
        float(first.log_softmax(-1).max()), abs=1e-4)


def test_speculative_decoding_verifies_against_the_penalised_distribution(tokenizer):
    """Greedy with penalties: MTP drafts come from the plain MTP head, but verification must use the
    penalised target, so the output is exactly what plain decoding with the penalties gives."""
    model = tiny_model(vocab=12, gain=3.0)  # a small vocabulary: the random MTP draft is right sometimes
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.4,
                            logit_bias=((5, 2.0), (7, -1.0)), min_tokens=3)
    prompts = [[3, 4, 5, 3, 4], [7, 7, 8], [1, 2, 3], [10, 0]]
    plain = Engine(model).generate([Request(p, 24, params, logprobs=2) for p in prompts])
    spec_engine = Engine(model, speculative=True)
    spec = spec_engine.generate([Request(p, 24, params, logprobs=2) for p in prompts])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [e.logprob for r in spec for e in r.logprobs] == \
        pytest.approx([e.logprob for r in plain for e in r.logprobs], abs=1e-4)
    assert 0 < spec_engine.last_stats.accepted < spec_engine.last_stats.drafted  # both branches were taken
    unpenalised = Engine(model).generate([Request(p, 24) for p in prompts])
    assert [r.token_ids for r in unpenalised] != [r.token_ids for r in plain]


def test_speculative_sampling_with_penalties_follows_the_penalised_distribution():
    """Sampled: the second token is the first one a draft is verified for; over 3,000 seeded requests the
    pair (t1, t2) follows the distribution the definitions give, with t2's penalties counting t1."""
    from .test_infer_speculative import chi_square_p

    model = tiny_model(vocab=6, gain=2.0, seed=1)
    prompt, bias = [1, 4, 2], {3: 1.0}
    params = dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5,
                  logit_bias=tuple(bias.items()))
    engine = Engine(model, speculative=True)
    results = engine.generate([Request(prompt, 2, SamplingParams(**params, seed=i)) for i in range(3000)])
    assert 0.1 < engine.last_stats.acceptance_rate < 0.95
    counts = torch.zeros(6, 6)
    for r in results:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(6, -1), torch.arange(6)[:, None]], dim=1))
    p1 = _by_hand(logits[0, -2], prompt, [], 0.8, 0.5, 1.5, bias).exp()
    p2 = torch.stack([_by_hand(logits[t1, -1], prompt, [t1], 0.8, 0.5, 1.5, bias).exp() for t1 in range(6)])
    exact = p1[:, None] * p2
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3
    unpenalised = logits[0, -2].softmax(-1)[:, None] * logits[:, -1].softmax(-1)
    assert chi_square_p(counts.flatten(), unpenalised.flatten()) < 1e-6  # the test tells them apart


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 17), ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"300": 1}), ("logit_bias", [1]),
    ("min_tokens", -1), ("min_tokens", 5),
])
def test_out_of_range_values_get_one_400_naming_the_parameter(server, field, value):
    r = _post(server[0], {"prompt": [1, 2], "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["message"].startswith(field)


def test_chunked_prefill_gives_the_same_choices_and_penalised_tokens(model, tokenizer):
    """A prompt longer than the prefill budget is prefilled in chunks: its n seeded choices and a penalised
    request decode exactly as with whole prefills (the choices' shared prefill and the penalties' prompt
    counts must not depend on how the prompt was cut)."""
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    bodies = [{"prompt": prompt, "max_tokens": 12, "temperature": 1.2, "n": 3, "seed": 99, "ignore_eos": True},
              {"prompt": prompt[:30], "max_tokens": 12, "temperature": 0, "ignore_eos": True, **PENALTIES}]
    outputs = []
    for budget in (None, 8):
        engine = Engine(model, tokenizer)
        engine.max_prefill_tokens = budget
        with serving(create_app(engine, model_name="tiny", max_batch=8)) as url, ThreadPoolExecutor(1) as pool:
            # a stream decoding meanwhile: the server chunks prompts only while others decode
            running = pool.submit(_post, url, {"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True})
            time.sleep(0.5)
            outputs.append([[c["text"] for c in _post(url, b).json()["choices"]] for b in bodies])
            assert running.result().status_code == 200
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0][0])) > 1  # the choices differ from each other
