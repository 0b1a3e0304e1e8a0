"""`dsv3 bench pipeline`: its options reach the bubble benchmark (one JSON object with --json, a readable
report without), and bad input ends as one `error:` line with exit status 2 before any process starts."""

from __future__ import annotations

import json

import pytest

from dsv3.cli import main
from dsv3.parallel import pipeline_bench

ROW = {"schedule": "dualpipev", "pp": 2, "stages": 4, "layers_per_stage": [1, 1, 1, 1], "microbatches": 4,
       "step_wall_s": 0.5, "measured_bubble": 0.25, "measured_bubble_per_step": [0.25], "formula": "f",
       "formula_bubble_s": 0.01, "formula_bubble": 0.2, "F_s": 0.1, "B_s": 0.2, "I_s": 0.1, "W_s": 0.1,
       "peak_saved_activation_bytes_per_rank": [2**20, 2**19]}


@pytest.fixture
def specs(monkeypatch):
    """Records the specs `dsv3 bench pipeline` would measure, without starting processes."""
    seen = []

    def fake(specs, timeout_s):
        seen.extend(specs)
        return {"backend": "gloo", "rows": [ROW]}

    monkeypatch.setattr(pipeline_bench, "run_bubble_bench", fake)
    return seen


def test_json_report_and_defaults(specs, capsys):
    args = ["bench", "pipeline", "--pp", "2", "--pp-schedule", "dualpipev", "--layers", "4", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["rows"][0]["measured_bubble"] == 0.25
    (spec,) = specs
    assert (spec.pp, spec.schedule, spec.microbatches, spec.layers) == (2, "dualpipev", 8, 4)  # 2 x 4 stages


def test_text_report(specs, capsys):
    assert main(["bench", "pipeline", "--micro-batches", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "measured bubble 25.0%" in out and "peak saved activations per rank: 1.00 MiB, 0.50 MiB" in out
    assert specs[0].microbatches == 2


def test_ep_reaches_the_benchmark_and_the_hidden_share_is_reported(specs, capsys):
    ROW.update(ep=2, comm_hidden_share=0.375)
    try:
        assert main(["bench", "pipeline", "--pp-schedule", "dualpipev", "--micro-batches", "4", "--ep", "2"]) == 0
    finally:
        del ROW["ep"], ROW["comm_hidden_share"]
    assert "EP2 all-to-all hidden by the overlapped F&B pairs: 37.5%" in capsys.readouterr().out
    assert (specs[0].ep, specs[0].world) == (2, 4)


def test_hidden_share_arithmetic():
    """(pair time in order - pair time concurrent) / all-to-all time inside the pairs in order, medians."""
    def step(concurrent, pairs, a2a):
        return {"concurrent": concurrent, "pairs_s": pairs, "a2a_s": 2 * a2a, "a2a_in_pairs_s": a2a}

    steps = [step(False, 1.0, 0.4), step(True, 0.8, 0.5), step(False, 1.2, 0.4), step(True, 0.8, 0.1), None]
    share = pipeline_bench.hidden_share(steps)
    assert share["pairs_in_order_s"] == pytest.approx(1.1) and share["pairs_overlapped_s"] == 0.8
    assert share["hidden"] == pytest.approx(0.3 / 0.4) and share["a2a_step_s"] == pytest.approx(0.8)
    assert pipeline_bench.hidden_share([step(False, 1.0, 0.4)]) is None  # nothing ran concurrently


@pytest.mark.parametrize("args, message", [
    (["--pp-schedule", "gpipe"], "--pp-schedule must be one of"),
    (["--pp", "1"], "--pp must be 2..16"),
    (["--pp-schedule", "1f1b", "--micro-batches", "1"], "at least as many micro-batches as stages"),
    (["--pp-schedule", "dualpipev", "--layers", "2"], "would hold no layer"),
    (["--overlap"], "--overlap needs --pp-schedule dualpipev"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--pp", "4", "--ep", "8"], "--pp x --ep at most 16 processes"),
    (["--ep", "3"], "--ep 3 must divide the model's 16 routed experts"),
])
def test_bad_input_is_one_error_line(specs, capsys, args, message):
    assert main(["bench", "pipeline", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert specs == []
