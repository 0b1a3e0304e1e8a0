"""Documents to train on: the running Python's standard library by default, or user files and globs.

Each document has a stable name (its path relative to the folder or glob it came from; ``path:line`` for
a JSONL record). A JSONL line is ``{"text": ...}`` (a document of plain text) or ``{"messages": [...]}``
(a chat conversation in OpenAI's roles, with optional ``tools``: rendered by the chat template, the loss
on the assistant's turns only; ``dsv3.data.chat_sft``). The held-out split is chosen by a hash of that
name, so it does not move when files are added, and it is the same on every machine that has the same
files.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from dsv3.errors import DSV3Error

GLOB_CHARS = set("*?[")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Chat:
    """A conversation to fine-tune on: OpenAI-style messages and the tools they may call."""

    messages: list[dict]
    tools: list[dict] | None = None


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier: decides the split and the order
    text: str  # a chat's text is its record as canonical JSON (what the fingerprint and BPE training read)
    chat: Chat | None = None


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    val: list[Document]
    description: str  # where the documents came from, for logs and run.json
    fingerprint: str  # sha256 over names and contents: keys the tokenizer and token caches

    @property
    def train_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.train)


def load_corpus(specs: list[str] | None = None, val_fraction: float = 0.01) -> Corpus:
    """Documents from ``specs`` (files, folders, globs; ``.jsonl`` records with a ``text`` field), or
    the standard library's ``.py`` files when ``specs`` is empty; split about ``val_fraction`` off."""
    if not 0.0 < val_fraction < 1.0:
        raise DSV3Error(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if specs:
        docs = [doc for spec in specs for doc in _documents_from_spec(spec)]
        description = "files: " + ", ".join(specs)
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = list(_stdlib_documents(root))
        description = f"python stdlib: {root}"
    docs = _deduplicated_sorted(docs)
    if len(docs) < 2:
        raise DSV3Error(
            f"the corpus ({description}) has {len(docs)} non-empty document(s); at least 2 are "
            "needed to hold one out for validation"
        )
    train, val = split_by_name(docs, val_fraction)
    return Corpus(train=train, val=val, description=description, fingerprint=_fingerprint(docs))


def split_by_name(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """A document is held out when the hash of its name falls below ``val_fraction``; at least one is."""
    val = [d for d in docs if name_hash(d.name) < val_fraction]
    if not val:
        val = [min(docs, key=lambda d: name_hash(d.name))]
    held = {d.name for d in val}
    return [d for d in docs if d.name not in held], val


def name_hash(name: str) -> float:
    """A uniform number in [0, 1) from a document name (sha256, so stable across runs and machines)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def _stdlib_documents(root: Path):
    if not root.is_dir():
        raise DSV3Error(f"the standard library folder {root} does not exist; pass --data")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        text = _read_text(path)
        if text:
            yield Document(rel.as_posix(), text)


def _documents_from_spec(spec: str):
    if GLOB_CHARS & set(spec):
        matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not matches:
            raise DSV3Error(f"--data {spec!r} matches no files")
        for path in matches:
            yield from _documents_from_file(path, path.as_posix())
        return
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
        for file in files:
            yield from _documents_from_file(file, file.relative_to(path).as_posix())
    elif path.is_file():
        yield from _documents_from_file(path, path.name)
    else:
        raise DSV3Error(f"--data {spec!r}: no such file or folder")


def _documents_from_file(path: Path, name: str):
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, name)
        return
    text = _read_text(path)
    if text:
        yield Document(name, text)


def _jsonl_documents(path: Path, name: str):
    with path.open(encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise DSV3Error(f"{path}:{line_no}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
            if isinstance(record, dict) and "messages" in record:
                chat = _chat_record(record, f"{path}:{line_no}")
                canonical = json.dumps({"messages": chat.messages, "tools": chat.tools}, sort_keys=True,
                                       ensure_ascii=False)
                yield Document(f"{name}:{line_no}", canonical, chat)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DSV3Error(f"{path}:{line_no}: a JSONL record needs a string field 'text' or a list "
                                "'messages'")
            if record["text"]:
                yield Document(f"{name}:{line_no}", record["text"])


def _chat_record(record: dict, where: str) -> Chat:
    """A ``{"messages": [...], "tools": [...]}`` record checked enough that the template sees what it
    expects: a non-empty list of messages, each with a known role and a string content (null for an
    assistant turn that only calls tools)."""
    messages, tools = record["messages"], record.get("tools")
    if not isinstance(messages, list) or not messages:
        raise DSV3Error(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DSV3Error(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if m.get("role") not in CHAT_ROLES:
            raise DSV3Error(f"{where}: messages[{i}] has role {m.get('role')!r}; use one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if not (isinstance(content, str) or content is None and m["role"] == "assistant" and calls):
            raise DSV3Error(f"{where}: messages[{i}] needs a string 'content' (null only beside 'tool_calls')")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise DSV3Error(f"{where}: messages[{i}]: 'tool_calls' must be a list on an assistant message")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DSV3Error(f"{where}: 'tools' must be a list of objects")
    return Chat(messages, tools)


def _read_text(path: Path) -> str:
    """The file as text; binary files (a NUL byte in the first 8 KiB) are skipped as empty."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return ""
    return data.decode("utf-8", errors="replace")


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _deduplicated_sorted(docs: list[Document]) -> list[Document]:
    by_name: dict[str, Document] = {}
    for doc in docs:
        by_name.setdefault(doc.name, doc)
    return [by_name[name] for name in sorted(by_name)]


def _fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode("utf-8") + b"\0")
        h.update(hashlib.sha256(doc.text.encode("utf-8")).digest())
    return h.hexdigest()
