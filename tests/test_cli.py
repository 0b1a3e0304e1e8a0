"""The `dsv3` dispatcher: its one-line help per command stays true to the commands, `--version`, and one
option name for one thing across every command."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from dsv3.cli import COMMANDS, click_command, main


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
    assert all(re.search(rf"^  {re.escape(n)} +{re.escape(h)}$", out, re.M) for n, (_, h) in COMMANDS.items())


def test_version_prints_the_installed_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"dsv3 {version('dsv3')}\n"
