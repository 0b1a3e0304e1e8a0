"""Every `dsv3 ...` and `torchrun ... -m dsv3 ...` line in a shell block of README.md and docs/*.md parses:
its command exists and click accepts its options and their values, parsed in-process without running
anything. A renamed option or a bad choice in a guide fails here instead of in a reader's terminal."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from dsv3.cli import COMMANDS, click_command

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "console", "sh", "shell"}
FENCE = re.compile(r"^\s*```(\w*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
RUNS_DSV3 = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(dsv3|\.venv/bin/dsv3|torchrun)(\s|$)")


def _shell_lines(text: str):
    """(line number, joined command line) of each line in a shell block, `\\` continuations joined; in a
    console block only the `$ ` lines (the rest is output)."""
    lang, pending, start = None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang not in SHELL_BLOCKS:
            continue
        if not pending:
            stripped = line.strip()
            if lang == "console":
                if not stripped.startswith("$ "):
                    continue
                stripped = stripped[2:]
            start, line = number, stripped
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def _dsv3_args(line: str) -> list[str] | None:
    """The words after `dsv3` (or after torchrun's `-m dsv3`) up to the first shell operator, or None when
    the line runs something else. A literal `...` ("more options") is dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    words, tokens = [], list(lexer)
    for at, word in enumerate(tokens):
        if word and set(word) <= set("|&;<>()"):
            if word == "|" and tokens[at + 1:at + 2] and tokens[at + 1].startswith("-"):
                raise ValueError(f"pipes into an option, not a command: | {tokens[at + 1]} (a synopsis?)")
            break
        words.append(word)
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        return None
    if words[0] in ("dsv3", ".venv/bin/dsv3"):
        rest = words[1:]
    elif words[0] == "torchrun" and "dsv3" in words:
        at = words.index("dsv3")
        if words[at - 1] != "-m":
            return None
        rest = words[at + 1:]
    else:
        return None
    return [w for w in rest if w != "..."]


def _doc_commands():
    for path in GUIDES:
        for number, line in _shell_lines(path.read_text()):
            if not RUNS_DSV3.match(line):
                continue
            try:
                args = _dsv3_args(line)
            except ValueError as exc:  # shlex's unbalanced quotes, or a synopsis
                args = f"{line}\n  not a shell command line: {exc}"
            if args is not None:
                yield pytest.param(args, id=f"{path.relative_to(ROOT)}:{number}")


def _parse(args: list[str]) -> None:
    """Resolve the subcommand and let click parse the rest (types, choices, required values); `--help`
    and `--version` count as parsed."""
    if args[:1] in (["--help"], ["--version"], []):
        return
    name, rest = args[0], args[1:]
    assert name in COMMANDS, f"unknown command {name!r}"
    command, prog = click_command(name), f"dsv3 {name}"
    while getattr(command, "commands", None) and rest and rest[0] in command.commands:
        prog += f" {rest[0]}"
        command, rest = command.commands[rest[0]], rest[1:]
    if getattr(command, "commands", None) and "--help" not in rest:
        pytest.fail(f"{prog} {' '.join(rest)}\n  no such subcommand; {prog} has {', '.join(command.commands)}")
    try:
        command.make_context(prog, list(rest), resilient_parsing=False)
    except Exception as exc:  # click's or typer's vendored copy: the class names match, the classes do not
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0:
            return
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        pytest.fail(f"{prog} {' '.join(rest)}\n  {type(exc).__name__}: {message}")


@pytest.mark.parametrize("args", list(_doc_commands()))
def test_documented_command_parses(args):
    if isinstance(args, str):
        pytest.fail(args)
    _parse(args)


def test_the_quickstart_puts_dsv3_and_torchrun_on_path():
    """The README's Quickstart says to activate .venv, and that is where `dsv3` and `torchrun` live: the
    bin folder of the interpreter running the tests (.venv's, as the Quickstart runs them)."""
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quickstart
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "activate").is_file()
    assert all(os.access(bin_dir / tool, os.X_OK) for tool in ("dsv3", "torchrun"))


def test_the_extractor_finds_the_guides_commands():
    """Guards the test above against finding nothing: the Quickstart's generate line and the torchrun lines
    are among the commands it checks."""
    found = [p.values[0] for p in _doc_commands()]
    assert len(found) > 40
    assert any(a[:1] == ["generate"] and "--max-new-tokens" in a for a in found)
    assert any(a[:1] == ["train"] and "--pp" in a for a in found)


@pytest.mark.parametrize("line", ["dsv3 plan train --no-such-option 1", "dsv3 convert A B --to hf --overwrite x",
                                  "dsv3 plan", "dsv3 net simulat", "dsv3 plan train --gpus many"])
def test_a_bad_line_fails_to_parse(line):
    """The check can fail: an unknown option, an extra argument, a group without its subcommand, a typo,
    a value of the wrong type."""
    with pytest.raises(pytest.fail.Exception):
        _parse(_dsv3_args(line))


def test_a_synopsis_is_not_a_command():
    with pytest.raises(ValueError, match="pipes into an option"):
        _dsv3_args("dsv3 paper --json | --markdown")
