"""`torchrun --nproc-per-node 4 -m dsv3 train --ep 4 --gpus-per-node 2`: experts sharded over four gloo
processes (2 nodes x 2, one expert group per node) train like one process (fp32 wire formats),
checkpoint as one full HF folder, and resume from per-rank optimizer state."""

from __future__ import annotations

import os

import pytest
import torch

import dsv3
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def test_expert_parallel_run_and_resume_match_one_process(make_opts, train_argv, torchrun, tmp_path):
    # a constant learning rate, so that a 2-step run resumed to 4 steps follows the 4-step schedule
    single = make_opts("single", steps=4, save_every=2, eval_every=2, warmup=0, min_lr_ratio=1.0)
    run_training(single, show_progress=False, plots=False)

    out = tmp_path / "ep"
    first = torchrun(4, train_argv(
        out, "--steps", "2", "--lr", str(single.lr), "--warmup", "0", "--min-lr-ratio", "1.0",
        "--save-every", "2", "--eval-every", "2", "--ep", "4", "--gpus-per-node", "2",
    ))
    assert first["world_size"] == 4 and first["parameters"] == single_parameters(single)
    assert os.path.exists(out / "checkpoints" / "step-000002" / "trainer_state.rank3.pt")
    second = torchrun(4, ["train", "--resume", str(out), "--steps", "4"])
    assert second["step"] == 4

    one, two = read_rows(single.out + "/metrics.jsonl"), read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in one if r["kind"] == "train"] == [
        r["step"] for r in two if r["kind"] == "train"
    ]
    for a, b in zip(
        [r for r in one if r["kind"] == "train"], [r for r in two if r["kind"] == "train"], strict=True
    ):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        assert a["expert_load"] == b["expert_load"]

    ref = dsv3.load_pretrained(single.out + "/latest")
    ep = dsv3.load_pretrained(out / "latest")  # one ordinary folder with every expert
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ep(ids), ref(ids), rtol=1e-4, atol=1e-4)


def single_parameters(opts) -> int:
    from dsv3.config import load_config
    from dsv3.model import Transformer

    return sum(p.numel() for p in Transformer(load_config(opts.config)).parameters())
