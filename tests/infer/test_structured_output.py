"""Structured output and tool calls: the DeepSeek-V3 tool-call parser (whole and streamed), the grammar's
logits processor in the engine (with MTP speculation, beside unconstrained rows), and the done-when checks
against a real `dsv3 serve --speculative mtp` process with the `openai` client on a tiny random V3
checkpoint whose tokenizer has DeepSeek's special tokens."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest

from dsv3.infer import chat_template, structured, tool_calls
from dsv3.infer.engine import Engine, Request
from dsv3.infer.grammar import Grammars
from dsv3.infer.loading import eos_ids
from dsv3.infer.sampling import GREEDY, SamplingParams
from dsv3.testing.http import serve_process

sys.path.insert(0, str(Path(__file__).parent))
from deepseek_tokens import deepseek_tokenizer  # noqa: E402

from conftest import tiny_model  # noqa: E402

openai = pytest.importorskip("openai")

PET = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "tags", "owner"],
       "properties": {
           "name": {"type": "string", "maxLength": 6},
           "kind": {"enum": ["cat", "dog", "bird"]},
           "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
           "owner": {"type": "object", "additionalProperties": False, "required": ["age", "ok"],
                     "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                    "ok": {"type": "boolean"}}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_pet", "parameters": PET}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HOT = 1.0
MODEL = "tiny"  # the checkpoint folder's name, which the server serves
BUDGET = 160  # tokens: the tiny random model writes PET's longest instance in about 100

B, E = tool_calls.CALLS_BEGIN + tool_calls.CALL_BEGIN, tool_calls.CALL_END
CALLS_TEXT = (f'Let me check.{B}function{tool_calls.SEP}get_weather\n```json\n{{"city": "Paris", "unit": "c"}}'
              f'\n```{E}\n{tool_calls.CALL_BEGIN}function{tool_calls.SEP}get_pet\n```json\n{{"name": "x"}}\n```{E}'
              f'{tool_calls.CALLS_END}')


# ---- the tool-call parser ----------------------------------------------------------------------

def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Content and calls rebuilt from a ToolCallStream fed ``text`` cut at ``cuts``, as a client would."""
    stream, content, calls = tool_calls.ToolCallStream(), "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for k, piece in enumerate(pieces):
        new, deltas = stream.push(piece, final=k == len(pieces) - 1)
        content += new
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append({"name": d["function"]["name"], "arguments": ""})
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def test_a_whole_response_parses_into_content_and_calls():
    parsed = tool_calls.parse(CALLS_TEXT)
    assert parsed.content == "Let me check."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris", "unit": "c"}'),
                                                           ("get_pet", '{"name": "x"}')]
    assert tool_calls.parse("no calls here").calls == []


@pytest.mark.parametrize("text", [CALLS_TEXT, "plain text, no calls <｜tool", "a```json\n\n```"])
def test_a_stream_cut_at_every_point_parses_as_the_whole(text):
    whole = tool_calls.parse(text)
    want = (whole.content, [{"name": c.name, "arguments": c.arguments} for c in whole.calls])
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == want, cut
    assert streamed(text, list(range(1, len(text)))) == want  # one character at a time


# ---- the grammar in the engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    tok, model = deepseek_tokenizer(), tiny_model(300)
    eos = eos_ids(model, tok)
    return model, tok, eos, Grammars(tok, 300, eos)


def test_json_schema_outputs_validate_with_speculation_and_leave_neighbours_alone(tiny):
    model, tok, eos, grammars = tiny
    prompt = tok.encode("hello").ids
    plain = [Request(tok.encode(p).ids, 24, GREEDY) for p in ("the cat", "a dog ran")]
    solo = [Engine(model, tok, eos_token_ids=eos).generate([r])[0].token_ids for r in plain]
    engine = Engine(model, tok, speculative=True, eos_token_ids=eos)
    for params in [GREEDY] + [SamplingParams(HOT, seed=s) for s in range(3)]:
        constrained = [Request(prompt, BUDGET, params, logits_processors=(grammars.json_schema(PET, "rf"),))
                       for _ in range(2)]
        fresh = [Request(r.prompt_ids, 24, GREEDY) for r in plain]
        outs = engine.generate(constrained + fresh)
        for out in outs[:2]:
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.text), PET)
        assert [o.token_ids for o in outs[2:]] == solo
    assert engine.last_stats.drafted > 0


def test_a_constrained_greedy_output_is_the_same_with_and_without_speculation(tiny):
    model, tok, eos, grammars = tiny
    outs = [Engine(model, tok, speculative=s, eos_token_ids=eos).generate(
        [Request(tok.encode("hi").ids, BUDGET, GREEDY, logits_processors=(grammars.json_schema(PET, "rf"),))])[0]
        for s in (False, True)]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].finish_reason == "stop"


def test_the_budget_running_out_ends_with_length_and_a_prefix_of_valid_json(tiny):
    model, tok, eos, grammars = tiny
    out = Engine(model, tok, eos_token_ids=eos).generate(
        [Request(tok.encode("hi").ids, 12, GREEDY, logits_processors=(grammars.json_schema(PET, "rf"),))])[0]
    assert out.finish_reason == "length" and out.text.startswith('{"name": "')


def test_dsv3_s_own_tokenizer_works_too():
    from dsv3.data.tokenizer import _train_bpe

    tok = _train_bpe(["the cat sat on the mat", "hello world", '{"city": "Paris", "unit": "c"}'] * 4, 300)
    model = tiny_model(300)
    eos = eos_ids(model, tok)  # its <|end_of_text|>
    grammars = Grammars(tok, 300, eos)
    for seed in range(3):
        request = Request(tok.encode("hello").ids, BUDGET, SamplingParams(HOT, seed=seed),
                          logits_processors=(grammars.json_schema(WEATHER, "rf"),))
        out = Engine(model, tok, eos_token_ids=eos).generate([request])[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in eos
        jsonschema.validate(json.loads(out.text), WEATHER)


def test_a_call_sent_back_with_its_result_reaches_the_chat_template_with_the_tools(tiny):
    """The assistant's tool_calls (as the openai client returns them) and a tool result in the history, with
    the tools, are rendered by the chat template into exactly the prompt the server then decodes."""
    from dsv3.infer.server import create_app
    from dsv3.testing.http import serving

    model, tok, eos, _ = tiny
    with serving(create_app(Engine(model, tok, eos_token_ids=eos), model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                               temperature=0, max_tokens=BUDGET).choices[0].message
        (call,) = first.tool_calls
        history = [*ASK, first.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "a cat"}]
        reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                               max_tokens=8)
    calls = [{"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": call.function.arguments}}]
    rendered = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "a cat", "tool_call_id": call.id}]
    prompt = chat_template.render(rendered, tok, tools=TOOLS)
    assert "<｜tool▁sep｜>get_weather\n```json\n" + call.function.arguments in prompt and "a cat" in prompt
    ids = chat_template.encode_prompt(tok, prompt)
    assert reply.usage.prompt_tokens == len(ids)
    want = Engine(model, tok, eos_token_ids=eos).generate(
        [Request(ids, 8, GREEDY, stop_strings=chat_template.stop_strings(tok), skip_special_tokens=False)])[0]
    assert reply.choices[0].message.content == tool_calls.parse(want.text).content


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_fields_are_named(tiny, fields, param):
    with pytest.raises(structured.FieldError) as info:
        structured.plan(tiny[3], fields.get("response_format"), fields.get("tools"), fields.get("tool_choice"),
                        fields.get("parallel_tool_calls"), fields.get("ignore_eos", False))
    assert info.value.param == param and str(info.value).startswith(param)


# ---- done when: a real server, the openai client ----------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints") / MODEL
    tiny_model(300).save_pretrained(folder)
    deepseek_tokenizer().save(str(folder / "tokenizer.json"))
    args = ["--model", str(folder), "--threads", "1", "--quiet", "--speculative", "mtp", "--max-batch", "8"]
    with serve_process(args, folder / "stderr.txt") as url:
        yield url


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_named_tool_choice_gives_valid_calls_20_of_20(client):
    def ask(i):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=HOT, max_tokens=BUDGET, seed=i)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(20)))
    for c in choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_named_tool_choice_streamed_gives_valid_calls_20_of_20(client):
    def ask(i):
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                temperature=HOT, max_tokens=BUDGET, seed=100 + i, stream=True)
        heads, args, reasons, content = [], "", [], ""
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                assert d.index == 0
                if d.id is not None:
                    heads.append((d.id, d.function.name))
                args += d.function.arguments or ""
            reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        return heads, args, reasons, content

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(20)))
    for heads, args, reasons, content in results:
        assert len(heads) == 1 and heads[0][1] == "get_weather" and reasons == ["tool_calls"] and content == ""
        jsonschema.validate(json.loads(args), WEATHER)


def test_a_streamed_call_equals_the_same_seed_s_whole_response(client):
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=HOT,
                      max_tokens=BUDGET, seed=seed)
        whole = client.chat.completions.create(**kwargs).choices[0]
        calls: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                name, args = calls.setdefault(d.index, ["", ""])
                calls[d.index] = [name + (d.function.name or ""), args + (d.function.arguments or "")]
        assert [[c.function.name, c.function.arguments] for c in whole.message.tool_calls] == \
            [calls[i] for i in sorted(calls)]


def test_required_with_one_call_only_calls_one_of_the_tools(client):
    for i in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=HOT, max_tokens=BUDGET, seed=i)
        (call,) = r.choices[0].message.tool_calls
        schema = {"get_weather": WEATHER, "get_pet": PET}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_json_schema_50_of_50_beside_greedy_requests_that_match_their_solo_outputs(client):
    plain = [[{"role": "user", "content": text}] for text in ("the cat sat", "hello world", "a dog ran")]

    def greedy(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_tokens=48).choices[0].message.content

    solo = [greedy(m) for m in plain]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}

    def constrained(i):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=HOT,
                                           max_tokens=BUDGET, seed=i)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        neighbours = [pool.submit(greedy, m) for m in plain]
        choices = list(pool.map(constrained, range(50)))
        together = [f.result() for f in neighbours]
    for c in choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PET)
    assert together == solo


def test_json_object_and_bad_fields_over_http(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=BUDGET)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # out of budget: a JSON object begun
        assert r.choices[0].message.content.startswith("{")
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    bad = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    assert "no tool named 'nope'" in bad.json()["error"]["message"]
    completion = {"prompt": "the cat", "max_tokens": 4, "tools": TOOLS}  # tools are for chat only
    bad = httpx.post(server + "/v1/completions", json=completion, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    ok = httpx.post(server + "/v1/completions", json={**completion, "tools": None, "response_format": fmt,
                                                      "temperature": 0, "max_tokens": 40}, timeout=60).json()
    jsonschema.validate(json.loads(ok["choices"][0]["text"]), WEATHER)


def test_n_choices_each_follow_their_own_grammar(client):
    """n > 1: each choice has its own grammar state (a shared matcher would follow the tokens of several
    choices at once and reject valid output), so every choice validates, whole and as tool calls."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=HOT,
                                       max_tokens=BUDGET, seed=7, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), WEATHER)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                       temperature=HOT, max_tokens=BUDGET, seed=8, n=3)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
