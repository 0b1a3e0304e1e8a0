"""A checkpoint's chat template: found beside its tokenizer, rendered exactly as transformers renders it.

Chat models are prompted (and fine-tuned) with the Jinja ``chat_template`` their tokenizer ships; a prompt
built any other way is a prompt the model was not trained on. ``render`` reproduces the environment of
transformers' ``apply_chat_template(..., tokenize=False)`` (a sandboxed, immutable Jinja environment with
``trim_blocks``/``lstrip_blocks`` and loop controls; a ``tojson`` that does not escape HTML;
``raise_exception``, ``strftime_now``, a safe ``dict`` and ``namespace``; the variables ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's named special tokens and any extra
keyword) without importing transformers, so the same text comes out of ``dsv3 serve`` and of training.

Where a template comes from, first found wins: a file the user names (``--chat-template``),
``chat_template.jinja`` beside the tokenizer (plus named ones in ``additional_chat_templates/``),
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}``), DeepSeek-V3's
format when the tokenizer has DeepSeek's role tokens, and otherwise a plain-text "User: ... / Assistant:"
conversation for dsv3's own small BPE models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error
from dsv3.io import read_json_object, require_regular_file

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
LEGACY_SPECIAL_TOKENS = "special_tokens_map.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning travels under
DEEPSEEK_USER = "<｜User｜>"
PLAIN_STOPS = ("\nUser:",)
_PACKAGED = Path(__file__).with_name("chat_templates")


@dataclass(frozen=True)
class ChatTemplate:
    """Jinja template(s) by name ("default" for a single one), the special tokens the template sees
    (``bos_token``, ``eos_token``, ...), where it came from (for messages), and the stop strings a reply
    ends at when the template has no end token of its own."""

    templates: dict[str, str]
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = "built-in"
    stop_strings: tuple[str, ...] = ()

    def source(self, tools: list | None = None) -> str:
        """The template a conversation uses: as transformers picks among named ones, ``tool_use`` when
        tools are given and it exists, else ``default``."""
        if len(self.templates) == 1 and "default" in self.templates:
            return self.templates["default"]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise DSV3Error(f"{self.origin} has several chat templates ({', '.join(sorted(self.templates))}) and no "
                        "'default'; name one with --chat-template FILE")

    def checked(self) -> ChatTemplate:
        """This template, once each of its sources compiles (a syntax error is one DSV3Error now, not at
        the first request)."""
        for source in self.templates.values():
            _compiled(source)
        return self

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
               **kwargs: Any) -> str:
        """The conversation as text, exactly as ``apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **kwargs)`` writes it. A template that rejects the
        conversation (``raise_exception``) or fails to render raises one DSV3Error."""
        import jinja2

        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return _compiled(self.source(tools)).render(
                messages=_template_messages(messages), tools=_plain(tools), documents=None,
                add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise DSV3Error(f"chat template ({self.origin}): {exc}") from None


def packaged(name: str, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """One of dsv3's own templates: ``deepseek_v3`` or ``plain``."""
    text = (_PACKAGED / f"{name}.jinja").read_text(encoding="utf-8")
    stops = PLAIN_STOPS if name == "plain" else ()
    return ChatTemplate({"default": text}, dict(special_tokens or {}), f"dsv3's {name} template", stops)


def default_for(tokenizer) -> ChatTemplate:
    """DeepSeek-V3's template for a tokenizer with DeepSeek's role tokens, the plain one otherwise."""
    if tokenizer is not None and tokenizer.token_to_id(DEEPSEEK_USER) is not None:
        return packaged("deepseek_v3")
    return packaged("plain")


def load_chat_template(folder: str | Path | None, tokenizer=None, override: str | Path | None = None) -> ChatTemplate:
    """The template for a checkpoint (or tokenizer) folder, searched in the order the module docstring
    gives; ``tokenizer`` (a ``tokenizers.Tokenizer``) decides the built-in fallback."""
    special = special_tokens(folder) if folder is not None else {}
    if override is not None:
        path = require_regular_file(override)
        return ChatTemplate({"default": _read_text(path)}, special, str(path))
    found = _templates_in(Path(folder)) if folder is not None else None
    if found is not None:
        return ChatTemplate(found[0], special, found[1])
    fallback = default_for(tokenizer)
    return ChatTemplate(fallback.templates, special, fallback.origin, fallback.stop_strings)


def special_tokens(folder: str | Path) -> dict[str, str]:
    """The named special tokens (``bos_token``, ``eos_token``, ...) of ``tokenizer_config.json`` (and of the
    older ``special_tokens_map.json``, which it overrides), as strings: transformers passes these to the
    template."""
    tokens: dict[str, str] = {}
    for name in (LEGACY_SPECIAL_TOKENS, TOKENIZER_CONFIG):
        path = Path(folder) / name
        if path.is_file():
            config = read_json_object(path)
            for key in SPECIAL_TOKEN_NAMES:
                value = config.get(key)
                if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
                    value = value.get("content")
                if isinstance(value, str):
                    tokens[key] = value
    return tokens


def _templates_in(folder: Path) -> tuple[dict[str, str], str] | None:
    """A folder's own template(s) and where they came from, or None. The .jinja files take precedence over
    tokenizer_config.json, as transformers gives them."""
    named = {}
    if (folder / TEMPLATE_FILE).is_file():
        named["default"] = _read_text(folder / TEMPLATE_FILE)
    if (folder / NAMED_TEMPLATES_DIR).is_dir():
        for path in sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja")):
            named[path.name.removesuffix(".jinja")] = _read_text(path)
    if named:
        return named, str(folder / TEMPLATE_FILE if "default" in named else folder / NAMED_TEMPLATES_DIR)
    config_path = folder / TOKENIZER_CONFIG
    if not config_path.is_file():
        return None
    value = read_json_object(config_path).get("chat_template")
    if value is None:
        return None
    origin = f"{config_path} chat_template"
    if isinstance(value, str):
        return {"default": value}, origin
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, origin
    raise DSV3Error(f"{origin} must be a string or a list of {{\"name\": ..., \"template\": ...}} objects")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DSV3Error(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise DSV3Error(f"{path} is not UTF-8 text") from None


# ---- the Jinja environment transformers renders templates in --------------------------------------

def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON as ``json.dumps`` writes it: Jinja's own filter would escape <, > and & for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _SafeDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    """Jinja's ``namespace`` refusing underscore names, so a template cannot reach CPython internals."""
    import jinja2

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature: namespace(self=...) must still work
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return SafeNamespace


def _generation_tag():
    """``{% generation %}...{% endgeneration %}``, which some templates wrap around the assistant's text for
    transformers' assistant masks: rendered as its body (dsv3 finds the assistant's tokens itself,
    ``dsv3.data.chat_sft``)."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return GenerationTag


@lru_cache(maxsize=32)
def _compiled(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_SafeDict(),
                       namespace=_namespace_class())
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DSV3Error(f"chat template line {exc.lineno}: {exc.message}") from None


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to the template: keys whose value is None dropped (templates
    test for a missing key, not for None), plain JSON data only, and the reasoning copied under each
    of its names."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise DSV3Error(f"each chat message must be an object, got {message!r}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value):
    """JSON data rebuilt from plain types, so the sandbox never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
