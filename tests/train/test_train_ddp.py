"""`torchrun --nproc-per-node 2 -m dsv3 train` (DDP over gloo on CPU) computes the same steps as one
process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def test_two_processes_match_one_process(make_opts, tmp_path):
    steps = 4
    single = make_opts("single", steps=steps, batch_size=4, save_every=100, eval_every=2)
    run_training(single, show_progress=False, plots=False)

    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "dsv3",
        "train",
        "--config",
        single.config,
        "--data",
        single.data[0],
        "--out",
        str(out),
        "--cache-dir",
        single.cache_dir,
        "--device",
        "cpu",
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--lr",
        str(single.lr),
        "--save-every",
        "100",
        "--eval-every",
        "2",
        "--eval-tokens",
        str(single.eval_tokens),
        "--val-fraction",
        "0.1",
        "--json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # only rank 0 prints
    assert summary["world_size"] == 2 and summary["step"] == steps

    one, two = read_rows(single.out + "/metrics.jsonl"), read_rows(out / "metrics.jsonl")
    assert [r["kind"] for r in one] == [r["kind"] for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "mtp_loss", "balance_loss", "grad_norm", "val_loss", "val_bpb"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        if a["kind"] == "train":
            assert a["expert_load"] == b["expert_load"]  # loads summed over both ranks
