"""Chat fine-tuning data: a conversation's tokens are apply_chat_template's, and the loss mask covers exactly
the assistant's tokens (by hand on a small conversation; as transformers' own assistant mask where a
template marks it with {% generation %})."""

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from dsv3.data.chat_sft import chat_tokens
from dsv3.data.chat_template import load_chat_template, packaged
from dsv3.data.corpus import Chat

from .chats import CONVERSATIONS, LOOPS_AND_FILTERS, WEATHER_TOOL

# Marks the assistant's text, tool calls and end token for transformers' assistant mask; lays out
# whitespace after each turn (which the mask leaves out).
MARKED = """\
{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'assistant' %}
<|assistant|>
{% generation %}{{ m.content | default('', true) }}
        {% for call in m.tool_calls | default([]) %}
<call>{{ call.function | tojson }}</call>
        {% endfor %}
{{ eos_token }}{% endgeneration %}
    {% else %}
<|{{ m.role }}|>
{{ m.content | trim }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""


def _ours(folder, messages, tools=None):
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return chat_tokens(tokenizer, load_chat_template(folder, tokenizer), Chat(messages, tools))


@pytest.fixture(scope="module", params=["deepseek_v3", "loops"])
def template_dir(request, hf_tokenizer_dir):
    source = packaged("deepseek_v3").source() if request.param == "deepseek_v3" else LOOPS_AND_FILTERS.replace(
        "today", "'2 December'")
    return hf_tokenizer_dir(source, name=request.param)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_chat_tokens_are_apply_chat_templates(template_dir, conversation, with_tools):
    tools = [WEATHER_TOOL] if with_tools else None
    messages = CONVERSATIONS[conversation]
    ids, mask = _ours(template_dir, messages, tools)
    want = AutoTokenizer.from_pretrained(template_dir).apply_chat_template(messages, tools=tools)["input_ids"]
    assert ids == want
    assert len(mask) == len(ids) and mask.any() == any(m["role"] == "assistant" for m in messages)


def test_mask_by_hand_on_a_small_conversation(hf_tokenizer_dir):
    """DeepSeek-V3's layout: BOS <｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>Thanks
    <｜Assistant｜>Bye<｜end▁of▁sentence｜>: the loss covers Hello, Bye and each end token."""
    folder = hf_tokenizer_dir(None, name="hand")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye"}]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {name: tok.token_to_id(name) for name in
               ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")}
    bos, eos, user, assistant = special.values()

    def text(s):
        return tok.encode(s, add_special_tokens=False).ids

    pieces = [([bos, user] + text("Hi") + [assistant], False), (text("Hello") + [eos], True),
              ([user] + text("Thanks") + [assistant], False), (text("Bye") + [eos], True)]
    ids, mask = _ours(folder, messages)
    assert ids == [t for piece, _ in pieces for t in piece]
    assert mask.tolist() == [flag for piece, flag in pieces for _ in piece]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_mask_equals_transformers_assistant_mask_where_the_template_marks_it(hf_tokenizer_dir, conversation):
    folder = hf_tokenizer_dir(MARKED, name="marked")
    messages = CONVERSATIONS[conversation]
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, return_assistant_tokens_mask=True)
    ids, mask = _ours(folder, messages)
    assert ids == want["input_ids"]
    assert mask.astype(int).tolist() == want["assistant_masks"]


