"""Interrupt (SIGTERM) and resume: the per-step losses equal an uninterrupted run bit for bit (CPU, fp32);
checkpoints are complete HF folders; the last K are kept; a resume cannot silently change the run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.train.checkpoints import complete_checkpoints
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def _train_rows(run_dir):
    return [r for r in read_rows(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"]


def test_sigterm_then_resume_matches_uninterrupted_bit_for_bit(make_opts):
    full_opts = make_opts("full", steps=7, save_every=100, eval_every=100, keep_last=2)
    full = run_training(full_opts, show_progress=False, plots=False)
    assert full["stopped"] == "completed" and full["step"] == 7

    def sigterm_at_step_3(row):
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler asks for a stop after this step

    cut_opts = make_opts("cut", steps=7, save_every=100, eval_every=100, keep_last=2)
    cut = run_training(cut_opts, on_step=sigterm_at_step_3, show_progress=False, plots=False)
    assert cut["stopped"] == "signal" and cut["step"] == 3
    assert [s for s, _ in complete_checkpoints(cut_opts.out)] == [
        3
    ]  # stop => checkpoint, whatever save_every

    resumed = run_training(make_opts("cut", steps=7), resume=True, show_progress=False, plots=False)
    assert resumed["stopped"] == "completed" and resumed["step"] == 7

    a, b = _train_rows(full_opts.out), _train_rows(cut_opts.out)
    assert [r["step"] for r in b] == list(range(1, 8))
    for key in ("loss", "total_loss", "mtp_loss", "balance_loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert [r["expert_load"] for r in a] == [r["expert_load"] for r in b]
    assert a[-1]["loss"] < a[0]["loss"]

    ma = dsv3.load_pretrained(full_opts.out + "/latest")
    mb = dsv3.load_pretrained(cut_opts.out + "/latest")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_checkpoint_is_a_loadable_hf_folder_and_last_k_are_kept(make_opts):
    opts = make_opts(steps=6, save_every=2, keep_last=2)
    summary = run_training(opts, show_progress=False, plots=False)
    assert [s for s, _ in complete_checkpoints(opts.out)] == [4, 6]
    latest = summary["checkpoint"]
    assert latest.endswith("step-000006") and os.path.realpath(opts.out + "/latest") == latest
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "trainer_state.pt",
        "trainer_state.json",
    ):
        assert os.path.exists(os.path.join(latest, name)), name
    model = dsv3.load_pretrained(latest)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 16, model.config.vocab_size) and torch.isfinite(logits).all()
    # trained, so far from the uniform distribution's loss ln(V)
    labels = ids.roll(-1, 1)
    assert model.loss(ids, labels).lm_loss < torch.log(torch.tensor(320.0))


def test_resume_refuses_a_changed_defining_option_and_a_fresh_run_refuses_an_existing_folder(make_opts):
    opts = make_opts(steps=2, save_every=2)
    run_training(opts, show_progress=False, plots=False)
    from dsv3.train.cli import _options

    with pytest.raises(DSV3Error, match="--lr"):
        _options({"lr": 1.0}, opts.out)
    with pytest.raises(DSV3Error, match="already holds a run"):
        run_training(make_opts(steps=2), show_progress=False, plots=False)
    longer = _options({"steps": 4}, opts.out)  # the total may grow
    assert longer.steps == 4 and longer.lr == opts.lr
    assert run_training(longer, resume=True, show_progress=False, plots=False)["step"] == 4
