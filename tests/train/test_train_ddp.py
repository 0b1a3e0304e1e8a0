"""`torchrun --nproc-per-node 2 -m dsv3 train` (DDP over gloo on CPU) computes the same steps as one
process with the same global batch."""

from __future__ import annotations

import pytest

from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def test_two_processes_match_one_process(make_opts, train_argv, torchrun, tmp_path):
    steps = 4
    single = make_opts("single", steps=steps, batch_size=4, save_every=100, eval_every=2)
    run_training(single, show_progress=False, plots=False)

    out = tmp_path / "ddp"
    args = train_argv(out, "--steps", str(steps), "--lr", str(single.lr), "--save-every", "100", "--eval-every", "2")
    summary = torchrun(2, args)
    assert summary["world_size"] == 2 and summary["step"] == steps

    one, two = read_rows(single.out + "/metrics.jsonl"), read_rows(out / "metrics.jsonl")
    assert [r["kind"] for r in one] == [r["kind"] for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "mtp_loss", "balance_loss", "grad_norm", "val_loss", "val_bpb"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        if a["kind"] == "train":
            assert a["expert_load"] == b["expert_load"]  # loads summed over both ranks
