"""Tool calls in DeepSeek-V3's format, as its chat template writes them in an assistant turn:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(calls after the first start on a new line; text before the first marker is the message's content).

``parse`` reads the calls out of the text generated so far; ``ToolCallStream`` turns successive parses of
a growing text into OpenAI's stream deltas. Both hold back any tail that may still grow into a marker, so a
stream fed in any pieces gives the same content and calls as the whole text. ``grammar`` writes the Lark
grammar (llguidance's dialect) that holds a constrained output to valid calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsv3.infer.grammar import JSON_OPTIONS

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


@dataclass
class Call:
    name: str
    arguments: str
    complete: bool


@dataclass
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)


def _held(text: str, *endings: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``endings``."""
    best = 0
    for ending in endings:
        for n in range(min(len(ending) - 1, len(text)), best, -1):
            if text.endswith(ending[:n]):
                best = n
                break
    return best


def parse(text: str, final: bool = True) -> Parsed:
    """Content and calls in ``text``. ``final=False``: the text may still grow, so a tail that could become
    a marker is held back, a call's name appears only once its line is complete, and its arguments stop
    before anything that could become their closing fence."""
    begin = text.find(CALLS_BEGIN)
    if begin < 0:
        return Parsed(text if final else text[: len(text) - _held(text, CALLS_BEGIN)])
    parsed, pos = Parsed(text[:begin]), begin + len(CALLS_BEGIN)
    while True:
        start = text.find(CALL_BEGIN, pos)
        if start < 0:
            return parsed
        sep = text.find(SEP, start)
        if sep < 0:
            return parsed
        name_end = text.find("\n", sep)
        if name_end < 0:
            return parsed
        body = name_end + 1
        if text.startswith(FENCE_OPEN, body):
            body += len(FENCE_OPEN)
        elif FENCE_OPEN.startswith(text[body:]) and not final:
            return parsed  # the fence may still come
        name = text[sep + len(SEP) : name_end].strip()
        end = text.find(CALL_END, body)
        if end < 0:
            args = text[body:] if final else text[body : len(text) - _held(text[body:], FENCE_CLOSE + CALL_END)]
            parsed.calls.append(Call(name, _unfenced(args), False))
            return parsed
        parsed.calls.append(Call(name, _unfenced(text[body:end]), True))
        pos = end + len(CALL_END)


def _unfenced(args: str) -> str:
    return args[: -len(FENCE_CLOSE)] if args.endswith(FENCE_CLOSE) else args


class ToolCallStream:
    """OpenAI's chat deltas for a growing text: content, then per call a delta with its index, id, type
    and name, then deltas of ``function.arguments``."""

    def __init__(self):
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    def push(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """(new content, new tool-call deltas) after ``piece``; ``final`` releases what was held back."""
        self.text += piece
        parsed = parse(self.text, final)
        content = parsed.content[self.sent_content :]
        self.sent_content = len(parsed.content)
        deltas = []
        for i, call in enumerate(parsed.calls):
            new = call.arguments[self.sent_args[i] :] if i < len(self.ids) else call.arguments
            if i == len(self.ids):  # a new call: its id and name, with what its arguments have so far
                self.ids.append(call_id())
                self.sent_args.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": new}})
            elif new:
                deltas.append({"index": i, "function": {"arguments": new}})
            self.sent_args[i] = len(call.arguments)
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(calls: list[Call]) -> list[dict]:
    """``message.tool_calls`` of a whole response."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def grammar(tools: list[dict[str, Any]], token_id, only: str | None = None, many: bool = True) -> str:
    """A Lark grammar for one call of the function named ``only`` (or, with None, one or more calls of any
    of ``tools``, or exactly one when ``many`` is False), arguments valid under each function's
    ``parameters`` schema. ``token_id(text)`` gives a marker's special-token id."""
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    rules = []
    for i, tool in enumerate(chosen):
        fn = tool["function"]
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        rules.append(f'call_{i}: <[{token_id(CALL_BEGIN)}]> "function" <[{token_id(SEP)}]> '
                     f'{json.dumps(fn["name"] + chr(10) + FENCE_OPEN)} args_{i} {json.dumps(FENCE_CLOSE)} '
                     f'<[{token_id(CALL_END)}]>')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    call = " | ".join(f"call_{i}" for i in range(len(chosen)))
    repeat = ' ("\\n" call)*' if many and only is None else ""
    start = f"start: <[{token_id(CALLS_BEGIN)}]> call{repeat} <[{token_id(CALLS_END)}]>"
    return "\n".join([start, f"call: {call}", *rules]) + "\n"
