"""A chat conversation as training tokens: the ids ``apply_chat_template(messages, tokenize=True)`` gives,
and which of them the loss covers (the assistant's turns as the template writes them: their content,
tool calls and end token).

The mask comes from the template itself, without ``{% generation %}`` tags (DeepSeek's templates have
none): an assistant turn i spans from the end of the conversation before it rendered with the generation
prompt (``messages[:i]``, what the model is shown when it must answer) to the end of the conversation
through it (``messages[:i + 1]``), less the whitespace the template lays out after the turn (the model
need not learn to write it: its reply ends at the end token). Those character spans become token spans
through the tokenizer's offsets: a token is an assistant token when it overlaps a span (transformers'
rule for its masks).
"""

from __future__ import annotations

import numpy as np

from dsv3.data.chat_template import ChatTemplate
from dsv3.data.corpus import Chat
from dsv3.errors import DSV3Error

IGNORE_INDEX = -100  # a label the loss skips (Transformer.loss's default)


def assistant_spans(template: ChatTemplate, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the [start, end) character spans of its assistant turns."""
    messages, tools = chat.messages, chat.tools
    text = template.render(messages, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], tools=tools, add_generation_prompt=True) if i else ""
        through = template.render(messages[: i + 1], tools=tools)
        if not (text.startswith(through) and through.startswith(before)):
            raise DSV3Error(
                f"the chat template does not render the conversation up to message {i} as the start of the "
                "whole one, so its assistant tokens cannot be found (does it rewrite earlier turns?)")
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def chat_tokens(tokenizer, template: ChatTemplate, chat: Chat) -> tuple[list[int], np.ndarray]:
    """(ids, mask): the conversation's token ids (no special tokens added beyond the template's) and a
    bool per token, True for the assistant tokens the loss covers."""
    text, spans = assistant_spans(template, chat)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = np.zeros(len(encoding.ids), dtype=bool)
    for t, (start, end) in enumerate(encoding.offsets):
        mask[t] = any(start < span_end and end > span_start for span_start, span_end in spans)
    return encoding.ids, mask
