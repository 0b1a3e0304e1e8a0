"""`dsv3 train` from the command line: one JSON object on stdout, metrics rows, plots, a sample, and
one clear error line for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv3.cli import main

ROW_KEYS = {"step", "loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s", "expert_imbalance"}


def test_train_json_summary_metrics_plots_and_sample(train_argv, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        train_argv(
            out,
            "--steps",
            "8",
            "--eval-every",
            "4",
            "--save-every",
            "4",
            "--sample-tokens",
            "8",
            "--log-every",
            "2",
            "--json",
        )
    )
    captured = capsys.readouterr()
    assert code == 0
    summary = json.loads(captured.out)  # exactly one JSON object on stdout
    assert summary["step"] == 8 and summary["stopped"] == "completed"
    assert summary["final_loss"] < summary["first_loss"]
    assert 0 < summary["val_bpb"] < 8 and summary["tokens"] == 8 * 4 * 32
    assert summary["sample"].startswith("def") and len(summary["sample"]) > 3
    assert "step 8/8" in captured.err and "bits/byte" in captured.err

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 9)) and [r["step"] for r in evals] == [4, 8]
    assert all(ROW_KEYS <= set(r) for r in train)
    assert all(len(r["expert_imbalance"]) == 2 and min(r["expert_imbalance"]) >= 1.0 for r in train)
    # 8 experts, top-2, 4 x 32 tokens per step (main layer) + 4 x 31 (the MTP layer's MoE)
    assert [sum(layer) for layer in train[0]["expert_load"]] == [2 * 4 * 32, 2 * 4 * 31]
    lrs = [r["lr"] for r in train]  # warmup is min(100, 8 // 10) = 0 steps: cosine from the peak
    assert lrs[0] == pytest.approx(2e-3) and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[1]
    assert evals[-1]["val_bpb"] == pytest.approx(summary["val_bpb"])
    for png in ("loss_curve.png", "expert_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "run.json").read_text())["steps"] == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--precision", "fp16"], "--precision must be one of"),
        (["--batch-size", "3", "--grad-accum", "2"], "multiple of --grad-accum"),
        (["--seq-len", "4096"], "exceeds the model's max_position_embeddings"),
        (["--moe-output-format", "fp4"], "--moe-output-format must be one of"),
    ],
)
def test_bad_input_is_one_error_line(train_argv, tmp_path, capsys, extra, message):
    code = main(train_argv(tmp_path / "bad", "--steps", "2", *extra))
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_missing_data_and_missing_resume_folder(tmp_path, capsys):
    assert (
        main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"), "--steps", "1"]) == 2
    )
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a training run folder" in capsys.readouterr().err
    assert not Path(tmp_path / "nothing").exists()
