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
