"""The studies that train (`study logfmt --train`, `study fp8 --train`) show a progress bar on stderr
over every step of every run, and with --json stdout still holds one JSON object and nothing else."""

from __future__ import annotations

import json

from dsv3.cli import main


def test_logfmt_train_shows_progress_on_stderr_and_json_alone_on_stdout(
    tiny_config, corpus_dir, cache_dir, capsys, monkeypatch
):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # stderr counts as a terminal: the live bar is drawn
    code = main([
        "study", "logfmt", "--train", "--formats", "fp32,bf16", "--seeds", "0", "--steps", "3",
        "--config", str(tiny_config), "--data", str(corpus_dir), "--cache-dir", str(cache_dir),
        "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64", "--json",
    ])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out)  # the whole of stdout is one JSON object
    assert [r["format"] for r in result["runs"]] == ["fp32", "bf16"]
    assert "logfmt study: run 1/2 (fp32, seed 0)" in out.err and "logfmt study: run 2/2 (bf16, seed 0)" in out.err
    assert "6/6" in out.err  # the bar counts the steps of both runs
    assert "seed 0 bf16: val loss" in out.err


def test_fp8_train_progress_without_a_terminal_is_one_line_per_run(
    tiny_config, corpus_dir, cache_dir, tmp_path, capsys, monkeypatch
):
    from dsv3.studies.fp8_training import compare_training

    monkeypatch.setenv("TTY_COMPATIBLE", "0")  # a log file: plain lines, no bar
    result = compare_training(
        [0], tmp_path / "runs", variants=("bf16", "fp8-fine"), steps=2, batch_size=2, seq_len=16, eval_tokens=64,
        config=str(tiny_config), data=[str(corpus_dir)], cache_dir=str(cache_dir), val_fraction=0.1, device="cpu",
    )
    err = capsys.readouterr().err
    assert [r["variant"] for r in result["runs"]] == ["bf16", "fp8-fine"]
    assert err.splitlines()[0] == "fp8 study: run 1/2 (bf16, seed 0)" and "fp8 study: run 2/2 (fp8-fine, seed 0)" in err
    assert "\x1b[" not in err  # no terminal control codes in a log


def test_fp8_training_table_fits_80_columns(capsys, monkeypatch):
    """`study fp8 --train`'s table (it printed its Markdown text, whose rows broke across lines)."""
    from dsv3.studies.fp8_training import _emit

    monkeypatch.setenv("COLUMNS", "80")
    cell = {"val_loss": [4.4012, 4.3998, 4.4101], "mean_val_loss": 4.4037, "rel_gap_to_bf16": [0.001, -0.002, 0.0],
            "mean_rel_gap_to_bf16": 0.0003}
    summary = {v: cell for v in ("bf16", "fp8-fine", "fp8-tensor")}
    training = {"options": {"steps": 100, "batch_size": 8, "seq_len": 256}, "seeds": [0, 1, 2], "summary": summary,
                "bf16_seed_spread": 0.004}
    _emit({"training_comparison": training}, False, False, "")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "|" not in out
    assert all(x in out.split() for x in ("4.4012,", "4.3998,", "4.4101"))  # numbers whole, wrapped at spaces


def test_logfmt_training_table_fits_80_columns(capsys, monkeypatch):
    from dsv3.studies.logfmt_study import print_train_rich

    monkeypatch.setenv("COLUMNS", "80")
    seeds = [0, 1, 2, 3]
    cell = {"val_loss_mean": 4.41234, "val_loss_std": 0.0123, "val_loss_min": 4.4, "val_loss_max": 4.43,
            "val_loss_per_seed": {str(s): 4.4 + s / 1000 for s in seeds}, "delta_vs_bf16_mean": 0.0012,
            "delta_vs_bf16_std": 0.0004}
    print_train_rich({"config": {"seeds": seeds}, "summary": {f: cell for f in ("fp32", "bf16", "logfmt8-logspace")}})
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    assert {"4.4000,", "4.4010,", "4.4020,", "4.4030", "logfmt8-logspace"} <= set(out.replace("│", " ").split())


def test_a_stopped_or_lossless_run_ends_the_study_with_one_clear_error():
    """A study whose run was stopped (SIGTERM, Ctrl-C) or has no held-out loss says so in one DSV3Error
    (the CLI's one error line) instead of formatting a missing loss (a TypeError traceback before)."""
    import pytest

    from dsv3.errors import DSV3Error
    from dsv3.studies.progress import finished

    done = {"stopped": "completed", "step": 10, "val_loss": 4.2}
    assert finished(done, "bf16, seed 0") is done
    with pytest.raises(DSV3Error, match="the bf16, seed 0 run was stopped at step 3"):
        finished({"stopped": "signal", "step": 3, "val_loss": None}, "bf16, seed 0")
    with pytest.raises(DSV3Error, match=r"ended \(non-finite\) at step 5 without a held-out loss"):
        finished({"stopped": "non-finite", "step": 5, "val_loss": None}, "e4m3, seed 1")
