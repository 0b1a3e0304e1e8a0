"""Turning chat messages into a prompt. DeepSeek-V3's own template when the tokenizer has its role
tokens (assistant ``tool_calls`` and ``tool`` results written as that template writes them); otherwise a
plain-text one ("User: ...\\nAssistant: ...") that small models trained on plain text can follow, with
"\\nUser:" as a stop string so the model does not write the user's next turn."""

from __future__ import annotations

from dsv3.errors import DSV3Error
from dsv3.infer.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, FENCE_CLOSE, FENCE_OPEN, SEP

ROLES = ("system", "user", "assistant", "tool")
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
DEEPSEEK_USER, DEEPSEEK_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
PLAIN_STOPS = ("\nUser:",)


def _deepseek_style(tokenizer) -> bool:
    return tokenizer is not None and tokenizer.token_to_id(DEEPSEEK_USER) is not None


def render(messages: list[dict], tokenizer=None) -> str:
    """The prompt text for a conversation that the assistant answers next. A message has a role and a string
    content; an assistant message may instead (or also) have ``tool_calls`` (OpenAI's layout, arguments as
    a JSON string), with content None."""
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if m.get("role") not in ROLES or not (isinstance(m.get("content"), str) or calls and m["content"] is None):
            raise DSV3Error(f"each message needs a role in {ROLES} and a string content, got {m!r}")
    if _deepseek_style(tokenizer):
        return _deepseek(messages)
    names = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    lines = [f"{names[m['role']]}: {m['content'] or ''}" + _plain_calls(m.get("tool_calls")) for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def _deepseek(messages: list[dict]) -> str:
    """DeepSeek-V3's template: system text first, then turns; a run of tool results sits between
    tool-outputs markers, and the model answers right after them."""
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    out, in_tools = [DEEPSEEK_BOS + system], False
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out.append(("" if in_tools else OUTPUTS_BEGIN) + OUTPUT_BEGIN + content + OUTPUT_END)
            in_tools = True
            continue
        if role == "user":
            out.append(DEEPSEEK_USER + content)
        elif role == "assistant" and m.get("tool_calls"):
            out.append(DEEPSEEK_ASSISTANT + content + CALLS_BEGIN + "\n".join(map(_deepseek_call, m["tool_calls"]))
                       + CALLS_END + DEEPSEEK_EOS)
        elif role == "assistant":
            out.append((OUTPUTS_END if in_tools else DEEPSEEK_ASSISTANT) + content + DEEPSEEK_EOS)
        in_tools = in_tools and role == "system"
    return "".join(out) + (OUTPUTS_END if in_tools else DEEPSEEK_ASSISTANT)


def _deepseek_call(call: dict) -> str:
    fn = call["function"]
    return (CALL_BEGIN + call.get("type", "function") + SEP + fn["name"] + "\n" + FENCE_OPEN + fn["arguments"]
            + FENCE_CLOSE + CALL_END)


def _plain_calls(calls: list[dict] | None) -> str:
    return "".join(f"\n[call {c['function']['name']} {c['function']['arguments']}]" for c in calls or ())


def stop_strings(tokenizer=None) -> tuple[str, ...]:
    return () if _deepseek_style(tokenizer) else PLAIN_STOPS
