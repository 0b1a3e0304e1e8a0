"""The `dsv3` dispatcher: its one-line help per command stays true to the commands, `--version`, and one
option name for one thing across every command."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from dsv3.cli import COMMANDS, click_command, leaf_commands, main


def _names(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, re.IGNORECASE) is not None


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_one_liner_names_every_subcommand(name):
    """`dsv3 --help` is written by hand (loading every sub-app would import torch); this keeps it true."""
    group = click_command(name)
    subcommands = list(getattr(group, "commands", {}))
    missing = [sub for sub in subcommands if not _names(COMMANDS[name][1], sub)]
    assert not missing, f"`dsv3 --help` line of {name!r} does not name {missing}: {COMMANDS[name][1]!r}"


def test_convert_one_liner_names_every_target():
    from dsv3.convert import TARGETS

    assert all(_names(COMMANDS["convert"][1], t) for t in TARGETS), COMMANDS["convert"][1]


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, help_) in COMMANDS.items():  # each one-liner whole, folded under its command at 80 columns
        entry = re.search(rf"^  {re.escape(name)} +(.*(?:\n {{4,}}\S.*)*)", out, re.M)
        assert entry and " ".join(entry.group(1).split()) == help_, name


def test_version_prints_the_installed_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"dsv3 {version('dsv3')}\n"


# Spellings that name one thing; at most one of each set may be an option of any command.
SYNONYMS = [
    {"--topology", "--kind", "--network"},  # ft2 | ft3 | mpft | mrft | sf | df
    {"--pp-schedule", "--schedule"},  # the pipeline schedule
    {"--micro-batches", "--microbatches"},  # micro-batches per step
    {"--seq-len", "--seq"},  # tokens per sequence
    {"--node-limit", "--topk-groups"},  # the node limit M of the router
    {"--redundant-experts", "--redundant"},  # extra expert replicas (EPLB)
    {"--ep", "--ep-size"},  # the expert-parallel degree
    {"--cache-dtype", "--kv-dtype"},  # the dtype of the KV / latent cache
    {"--new-tokens", "--gen-len"},  # tokens generated per request, end of text ignored
]


def _options():
    """(command words, the option's long flags, its help) of every visible option of every command."""
    for path, command in leaf_commands():
        for param in command.params:
            if param.param_type_name == "option" and not getattr(param, "hidden", False):
                flags = tuple(f for f in param.opts if f.startswith("--"))
                yield " ".join(path), param.name, flags, " ".join((param.help or "").split()).lower()


def _spread(key_of) -> dict:
    """key -> {first long flag: [commands]} for the keys that more than one spelling shares."""
    seen: dict = {}
    for command, name, flags, help_ in _options():
        key = key_of(name, help_)
        if key:
            seen.setdefault(key, {}).setdefault(flags[0], []).append(command)
    return {k: v for k, v in seen.items() if len(v) > 1}


def test_one_spelling_for_each_known_synonym():
    used = {flag: command for command, _, flags, _ in _options() for flag in flags}
    clashes = [{f: used[f] for f in group if f in used} for group in SYNONYMS]
    assert all(len(c) <= 1 for c in clashes), [c for c in clashes if len(c) > 1]


def test_same_help_text_means_same_option_name():
    """Two options with the same help describe the same thing, so they must be spelled the same."""
    assert _spread(lambda name, help_: len(help_) > 12 and help_) == {}


def test_same_parameter_name_means_same_option_name():
    assert _spread(lambda name, help_: name) == {}
