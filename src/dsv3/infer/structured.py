"""What a chat request's ``response_format``, ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of
generation: the grammar that constrains it (if any), and whether its text is read for tool calls.

- ``response_format``: ``{"type": "text"}`` (the default) constrains nothing; ``{"type": "json_object"}``
  holds the output to one JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`` to one JSON value valid under ``schema`` (whatever ``strict`` says: the grammar is always
  strict).
- ``tool_choice`` (with ``tools``): ``"none"`` ignores the tools; ``"auto"`` (the default) lets the model
  write a call or not, and reads calls out of its text; ``"required"`` holds the output to one or more calls
  (exactly one with ``parallel_tool_calls: false``) and ``{"type": "function", "function": {"name": N}}`` to
  one call of N, arguments valid under the function's ``parameters`` schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dsv3.infer import tool_calls
from dsv3.infer.grammar import FieldError, Grammars
from dsv3.infer.logits_processors import LogitsProcessor

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class Plan:
    processors: tuple[LogitsProcessor, ...] = ()
    tool_calls: bool = False  # read tool calls out of the text (which then keeps special tokens)


UNCONSTRAINED = Plan()


def plan(grammars: Grammars, response_format: Any = None, tools: Any = None, tool_choice: Any = None,
         parallel_tool_calls: bool | None = None, ignore_eos: bool = False) -> Plan:
    """The generation plan of one request, every field checked (a FieldError names the bad one)."""
    tools = _tools(tools)
    choice = _choice(tool_choice, tools)
    if parallel_tool_calls is False and choice == "auto":
        raise FieldError("parallel_tool_calls: false needs tool_choice 'required' or a named function (the "
                         "grammar then allows exactly one call); with 'auto' the output is not constrained",
                         "parallel_tool_calls")
    schema = _schema(response_format)
    forced = choice not in ("none", "auto")
    if schema is not None and forced:
        raise FieldError("response_format cannot be combined with a required or named tool_choice (the output "
                         "is then a tool call)", "response_format")
    if ignore_eos and (schema is not None or forced):
        raise FieldError("ignore_eos cannot be combined with constrained output: the grammar ends with the "
                         "end-of-sequence token", "ignore_eos")
    if schema is not None:
        return Plan((grammars.json_schema(schema, "response_format"),))
    if not forced:
        return Plan(tool_calls=choice == "auto")
    only = choice if isinstance(choice, str) and choice != "required" else None
    lark = tool_calls.grammar(tools, _marker_id(grammars), only, many=parallel_tool_calls is not False)
    return Plan((grammars.lark(lark, "tool_choice"),), tool_calls=True)


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise FieldError("tools: must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise FieldError(f"{where}: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "{...}}}}", where)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise FieldError(f"{where}.function.name: must be 1 to 64 letters, digits, '_' or '-'",
                             f"{where}.function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(f"{where}.function.parameters: must be a JSON schema object",
                             f"{where}.function.parameters")
    return tools


def _choice(choice: Any, tools: list[dict]) -> str:
    """'none', 'auto', 'required', or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': ...}}", "tool_choice")
        names = [t["function"]["name"] for t in tools]
        if fn["name"] not in names:
            raise FieldError(f"tool_choice: no tool named {fn['name']!r} in tools ({', '.join(names) or 'none'})",
                             "tool_choice")
        return fn["name"]
    if choice not in ("none", "auto", "required"):
        raise FieldError(f"tool_choice: {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                         "tool_choice")
    if choice != "none" and not tools:
        raise FieldError(f"tool_choice: {choice!r} needs tools", "tool_choice")
    return choice


def _schema(response_format: Any) -> dict | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise FieldError("response_format.json_schema: must be {'name': ..., 'schema': {...}, 'strict': ...}",
                             "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise FieldError("response_format.json_schema.schema: must be a JSON schema object",
                             "response_format.json_schema.schema")
        return schema if isinstance(schema, dict) else {}
    raise FieldError("response_format: type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _marker_id(grammars: Grammars):
    def token_id(marker: str) -> int:
        tid = grammars.tokenizer.token_to_id(marker) if grammars.tokenizer is not None else None
        if tid is None:
            raise FieldError(f"tool_choice: the tokenizer has no {marker} token, so this model cannot write "
                             "DeepSeek-V3's tool calls", "tool_choice")
        return tid

    return token_id
