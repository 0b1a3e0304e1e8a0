"""Turning chat messages into a prompt, with the checkpoint's own chat template (``dsv3.data.chat_template``:
rendered as transformers renders it). A checkpoint without one gets DeepSeek-V3's template when its
tokenizer has DeepSeek's role tokens, otherwise a plain-text one ("User: ...\\nAssistant: ...") that small
models trained on plain text can follow, with "\\nUser:" as a stop string so the model does not write the
user's next turn."""

from __future__ import annotations

from dsv3.data.chat_template import ChatTemplate, default_for
from dsv3.errors import DSV3Error

ROLES = ("system", "user", "assistant")


def render(messages: list[dict], tokenizer=None, template: ChatTemplate | None = None,
           tools: list | None = None) -> str:
    """The prompt text for a conversation that the assistant answers next."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DSV3Error(f"each message needs a role, got {m!r}")
    template = template or default_for(tokenizer)
    return template.render(messages, tools=tools, add_generation_prompt=True)


def stop_strings(tokenizer=None, template: ChatTemplate | None = None) -> tuple[str, ...]:
    return (template or default_for(tokenizer)).stop_strings


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A rendered prompt's ids: the template wrote the special tokens it wants (BOS included), so the
    tokenizer adds none of its own, as ``apply_chat_template(tokenize=True)`` encodes."""
    return tokenizer.encode(text, add_special_tokens=False).ids
