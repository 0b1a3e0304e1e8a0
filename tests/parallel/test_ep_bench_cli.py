"""`dsv3 bench ep --json`: one JSON object with the promised figures, traffic equal to the analytic count."""

import importlib.util
import json

import pytest
import typer

from dsv3.bench_ep import main
from dsv3.errors import DSV3Error

app = typer.Typer()
app.command()(main)


def run(args):
    return app(args=args, prog_name="dsv3 bench ep", standalone_mode=False)


def test_bench_ep_json(capsys):
    run(
        [
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--experts",
            "8",
            "--topk",
            "2",
            "--node-limit",
            "1",
            "--tokens",
            "8",
            "--hidden",
            "128",
            "--dispatch",
            "fp8",
            "--combine",
            "logfmt10",
            "--overlap-repeats",
            "1",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    report = json.loads(out)  # exactly one JSON object on stdout
    assert out.count("\n") == 1
    for key in (
        "max_abs_diff_vs_single",
        "mean_inter_node_copies_per_token",
        "max_inter_node_copies_per_token",
        "inter_node_bytes",
        "intra_node_bytes",
        "dispatch_s",
        "compute_s",
        "combine_s",
        "overlap",
    ):
        assert key in report, key
    assert report["traffic_matches_analytic"]
    assert report["max_inter_node_copies_per_token"] <= 1
    assert 0 < report["max_abs_diff_vs_single"] < 0.1 * report["max_abs_single"]
    # fp8 rows of 128 + 4 bytes and LogFMT-10 rows of 160 + 4 bytes, one per inter-node copy and direction
    copies = report["mean_inter_node_copies_per_token"] * 2 * 8
    assert report["inter_node_bytes"] == pytest.approx(copies * (132 + 164))
    assert report["intra_node_bytes"] == 0  # one GPU per node: nothing to forward


@pytest.mark.parametrize(
    "args",
    [
        ["--dispatch", "fp4"],
        ["--combine", "e5m2"],
        ["--nodes", "0"],
        ["--node-limit", "3"],
        ["--redundant-experts", "2"],
    ],
)
def test_bench_ep_rejects_bad_input(args):
    with pytest.raises(DSV3Error):
        run(args)


@pytest.mark.skipif(
    importlib.util.find_spec("dsv3.infer.bench") is None,
    reason="dsv3 bench dispatcher also needs dsv3.infer.bench",
)
def test_dispatcher_reports_bad_input(capsys):
    from dsv3.cli import main as cli_main

    assert cli_main(["bench", "ep", "--dispatch", "fp4"]) == 2
    assert "error: --dispatch" in capsys.readouterr().err
