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
    args = ["bench", "pipeline", "--pp", "2", "--schedule", "dualpipev", "--layers", "4", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["rows"][0]["measured_bubble"] == 0.25
    (spec,) = specs
    assert (spec.pp, spec.schedule, spec.microbatches, spec.layers) == (2, "dualpipev", 8, 4)  # 2 x 4 stages


def test_text_report(specs, capsys):
    assert main(["bench", "pipeline", "--microbatches", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "measured bubble 25.0%" in out and "peak saved activations per rank: 1.00 MiB, 0.50 MiB" in out
    assert specs[0].microbatches == 2


@pytest.mark.parametrize("args, message", [
    (["--schedule", "gpipe"], "--schedule must be one of"),
    (["--pp", "1"], "--pp must be 2..16"),
    (["--schedule", "1f1b", "--microbatches", "1"], "at least as many micro-batches as stages"),
    (["--schedule", "dualpipev", "--layers", "2"], "would hold no layer"),
    (["--overlap"], "--overlap needs --schedule dualpipev"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bad_input_is_one_error_line(specs, capsys, args, message):
    assert main(["bench", "pipeline", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert specs == []
