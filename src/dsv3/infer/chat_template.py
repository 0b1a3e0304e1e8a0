"""Turning chat messages into a prompt. DeepSeek-V3's own template when the tokenizer has its role
tokens; otherwise a plain-text one ("User: ...\\nAssistant: ...") that small models trained on plain text
can follow, with "\\nUser:" as a stop string so the model does not write the user's next turn."""

from __future__ import annotations

from dsv3.errors import DSV3Error

ROLES = ("system", "user", "assistant")
DEEPSEEK_USER, DEEPSEEK_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
PLAIN_STOPS = ("\nUser:",)


def _deepseek_style(tokenizer) -> bool:
    return tokenizer is not None and tokenizer.token_to_id(DEEPSEEK_USER) is not None


def render(messages: list[dict[str, str]], tokenizer=None) -> str:
    """The prompt text for a conversation that the assistant answers next."""
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DSV3Error(f"each message needs a role in {ROLES} and a string content, got {m!r}")
    if _deepseek_style(tokenizer):
        system = "".join(m["content"] for m in messages if m["role"] == "system")
        turns = [(DEEPSEEK_USER if m["role"] == "user" else DEEPSEEK_ASSISTANT) + m["content"] +
                 (DEEPSEEK_EOS if m["role"] == "assistant" else "")
                 for m in messages if m["role"] != "system"]
        return DEEPSEEK_BOS + system + "".join(turns) + DEEPSEEK_ASSISTANT
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    lines = [f"{names[m['role']]}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def stop_strings(tokenizer=None) -> tuple[str, ...]:
    return () if _deepseek_style(tokenizer) else PLAIN_STOPS
