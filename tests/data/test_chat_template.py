"""The chat template renders as transformers' apply_chat_template renders it, for DeepSeek-V3's template and
for a template that uses loops, filters, namespaces, loop controls and raise_exception; each place a
template can come from is found."""

import json

import pytest
from transformers import AutoTokenizer

from dsv3.data.chat_template import load_chat_template, packaged
from dsv3.errors import DSV3Error

from .chats import CONVERSATIONS, LOOPS_AND_FILTERS, WEATHER_TOOL


def _both(folder, messages, **kwargs):
    ours = load_chat_template(folder).render(messages, **kwargs)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, **kwargs)
    return ours, theirs


@pytest.fixture(scope="module")
def deepseek_dir(hf_tokenizer_dir):
    return hf_tokenizer_dir(packaged("deepseek_v3").source(), name="deepseek")


@pytest.fixture(scope="module")
def loops_dir(hf_tokenizer_dir):
    return hf_tokenizer_dir(LOOPS_AND_FILTERS, name="loops")


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_deepseek_v3_template_renders_as_transformers(deepseek_dir, conversation, generation_prompt, with_tools):
    tools = [WEATHER_TOOL] if with_tools else None
    ours, theirs = _both(deepseek_dir, CONVERSATIONS[conversation], tools=tools,
                         add_generation_prompt=generation_prompt)
    assert ours == theirs
    assert ours.startswith("<｜begin▁of▁sentence｜>")


def test_deepseek_v3_template_writes_v3s_format(deepseek_dir):
    """The published layout, spelled out once by hand."""
    text = load_chat_template(deepseek_dir).render(CONVERSATIONS["tool calls"][:5], add_generation_prompt=True)
    call = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>'
    assert text == (
        "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris and Rome?<｜Assistant｜><｜tool▁calls▁begin｜>"
        + call.format('{"city": "Paris"}') + "\n" + call.format('{"city": "Rome"}')
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>rain, 14<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "Paris is sunny; Rome is rainy.<｜end▁of▁sentence｜><｜Assistant｜>")


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_loops_and_filters_template_renders_as_transformers(loops_dir, conversation, generation_prompt, with_tools):
    tools = [WEATHER_TOOL] if with_tools else None
    ours, theirs = _both(loops_dir, CONVERSATIONS[conversation], tools=tools,
                         add_generation_prompt=generation_prompt, today="2 December")
    assert ours == theirs


def test_raise_exception_is_one_clear_error(loops_dir):
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="a system message must come first"):
        AutoTokenizer.from_pretrained(loops_dir).apply_chat_template(messages, tokenize=False, today="x")
    with pytest.raises(DSV3Error, match="a system message must come first"):
        load_chat_template(loops_dir).render(messages, today="x")


def test_template_sources_in_order(hf_tokenizer_dir, tmp_path):
    """tokenizer_config.json's string and list-of-named forms, chat_template.jinja with named templates in
    additional_chat_templates/, an explicit file over all of them, and the built-ins when there is none."""
    messages = [{"role": "user", "content": "hi"}]
    in_config = hf_tokenizer_dir("[{{ messages[0].content }}]", name="in-config", jinja_files=False)
    assert (in_config / "tokenizer_config.json").read_text().count("chat_template") == 1
    assert load_chat_template(in_config).render(messages) == "[hi]"
    named = {"default": "D:{{ messages[0].content }}", "tool_use": "T:{{ tools | length }}"}
    for jinja_files in (False, True):
        folder = hf_tokenizer_dir(named, name="named", jinja_files=jinja_files)
        template = load_chat_template(folder)
        for tools in (None, [WEATHER_TOOL]):
            assert template.render(messages, tools=tools) == AutoTokenizer.from_pretrained(folder).apply_chat_template(
                messages, tools=tools, tokenize=False)
        assert template.render(messages, tools=[WEATHER_TOOL]) == "T:1"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}mine:{{ messages | length }}")
    assert load_chat_template(in_config, override=override).render(messages) == "<｜begin▁of▁sentence｜>mine:1"
    bare = hf_tokenizer_dir(None, name="bare")
    assert json.loads((bare / "tokenizer_config.json").read_text()).get("chat_template") is None
    from tokenizers import Tokenizer

    deepseek = load_chat_template(bare, Tokenizer.from_file(str(bare / "tokenizer.json")))
    assert deepseek.render(messages, add_generation_prompt=True) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"
    plain = load_chat_template(bare, None)
    assert plain.render(messages, add_generation_prompt=True) == "User: hi\nAssistant:"
    assert plain.stop_strings == ("\nUser:",)


def test_bad_templates_are_one_clear_error(hf_tokenizer_dir, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(DSV3Error, match="chat template line 1"):
        load_chat_template(None, override=broken).render([{"role": "user", "content": "x"}])
    with pytest.raises(DSV3Error, match="file not found"):
        load_chat_template(None, override=tmp_path / "missing.jinja")
    sandboxed = tmp_path / "escape.jinja"
    sandboxed.write_text("{{ messages.__class__.__mro__ }}{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(DSV3Error):
        load_chat_template(None, override=sandboxed).render([{"role": "user", "content": "x"}])
