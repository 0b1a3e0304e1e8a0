"""Every command's tables and --help read at 80 columns: no line wider than the terminal, no table
cropped, no label cut to an ellipsis, no number split across lines, and units that scale (a small
model's FLOPs are MFLOP, not "0.0 GFLOP")."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from dsv3.cli import main
from dsv3.termtable import fitted_table, fmt_bytes, fmt_flops, fmt_seconds

BOX_START, BOX_END = "┏┃┡│└├", "┓┃┩│┘┤"

COMMANDS = [
    ["analyze", "--preset", "nano"],
    ["analyze", "--preset", "deepseek-v3"],
    ["paper"],
    ["net", "topology"],
    ["net", "cost"],
    ["net", "simulate", "--topology", "ft2", "--gpus", "16"],
    ["net", "sweep", "--gpus", "16", "--sizes", "1MiB,1GiB", "--topologies", "mpft,ft3"],
    ["study", "accumulation", "--k", "256,512", "--trials", "1", "--size", "16"],
    ["study", "fp8", "--tokens", "256", "--dim", "256", "--outlier-scales", "0,100"],
    ["study", "logfmt", "--numel", "4096"],
]
HELP = [[], ["train"], ["analyze"], ["paper"], ["study"], ["study", "accumulation"], ["study", "fp8"],
        ["study", "logfmt"], ["net"], ["net", "topology"], ["net", "cost"], ["net", "simulate"], ["net", "sweep"],
        ["launch"]]


def _run(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out + out.err


def _layout_problems(text: str) -> list[str]:
    problems = []
    for line in text.splitlines():
        if len(line) > 80:
            problems.append(f"wider than 80: {line!r}")
        if "…" in line:
            problems.append(f"cut with an ellipsis: {line!r}")
        if line[:1] in BOX_START and line.rstrip()[-1:] not in BOX_END:
            problems.append(f"table cropped: {line!r}")
        if re.search(r"(?<![0-9.])0\.0+ [kMGTP]?FLOP", line):
            problems.append(f"zero in too large a unit: {line!r}")
    return problems


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_tables_fit_80_columns(argv, capsys, monkeypatch):
    assert _layout_problems(_run(argv, capsys, monkeypatch)) == []


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_fits_80_columns(argv, capsys, monkeypatch):
    assert _layout_problems(_run([*argv, "--help"], capsys, monkeypatch)) == []


def _tokens(text: str) -> set[str]:
    return set(re.split(r"[\s│┃]+", text))


def test_analyze_never_splits_a_number_or_a_hardware_name(capsys, monkeypatch):
    """Every word of every cell (a number, a unit, a hardware name) appears whole in the 80-column output;
    before, the hardware table printed 1021134.7 as "1021134." over "7" and folded "rtx4090-ddr5-server"."""
    import json

    from dsv3.analysis.render import analyze_sections

    report = json.loads(_run(["analyze", "--preset", "deepseek-v3", "--json"], capsys, monkeypatch))
    tokens = _tokens(_run(["analyze", "--preset", "deepseek-v3"], capsys, monkeypatch))
    words = {w for s in analyze_sections(report) for row in s.rows for cell in row for w in cell.split()}
    assert words - tokens == set()
    flops = [row[1] for s in analyze_sections(report) if s.title.startswith("FLOPs") for row in s.rows]
    assert all(not f.startswith("0.0") for f in flops), flops


def test_fitted_table_wraps_only_at_spaces():
    headers = ["hardware", "memory GB", "mem GB/s", "fits", "local decode TPS", "EP TPOT out", "EP TPOT up"]
    rows = [["rtx4090-ddr5-server", "1048", "614.4", "no: 12", "1021134.7", "15.11 ms", "0.5461 µs"]] * 3
    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(fitted_table(headers, rows, 80))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert {w for cell in rows[0] for w in cell.split()} <= _tokens(text)


def test_units_scale():
    assert fmt_flops(7.864e6) == "7.864 MFLOP" and fmt_flops(250.45e9) == "250.4 GFLOP"
    assert fmt_flops(2.473e12) == "2.473 TFLOP" and fmt_flops(512) == "512 FLOP"
    assert fmt_seconds(15.11e-3) == "15.11 ms" and fmt_seconds(9.83e-6) == "9.830 µs" and fmt_seconds(2) == "2.000 s"
    assert fmt_bytes(28_185_722_880) == "28.19 GB" and fmt_bytes(640) == "640 B"


def test_accumulation_readings_stay_whole_at_80_columns(capsys, monkeypatch):
    """The readings table has more long words than 80 columns hold: it folded 'bit-accurate' into
    'bit-accu' / 'rate' and '0.053%' into '0.05' / '3%'; now each reading is a block of lines."""
    text = _run(["study", "accumulation", "--readings", "--k", "256,1024", "--trials", "1", "--size", "16"],
                capsys, monkeypatch)
    assert _layout_problems(text) == []
    tokens = _tokens(text)
    assert {"bit-accurate", "--product-rounding", "complement:"} <= tokens
    assert all(re.fullmatch(r"[0-9.]+%", t) for t in tokens if t.endswith("%"))
