"""Real processes: SIGTERM finishes the step, checkpoints and exits 0; kill -9 at any moment leaves
every complete checkpoint loadable and the run resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import dsv3
from dsv3.train.checkpoints import complete_checkpoints
from dsv3.train.options import TrainOptions
from dsv3.train.run import run_training


def _start(train_argv, out: Path) -> subprocess.Popen:
    args = train_argv(out, "--steps", "100000", "--save-every", "1", "--eval-every", "100000", "--json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dsv3", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_steps(out: Path, proc: subprocess.Popen, steps: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and sum(1 for _ in metrics.open()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("training did not reach the expected step in time")


def test_sigterm_checkpoints_and_exits_zero_then_kill_9_leaves_loadable_checkpoints(train_argv, tmp_path):
    out = tmp_path / "run"
    proc = _start(train_argv, out)
    _wait_for_steps(out, proc, 3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["stopped"] == "signal"
    assert summary["checkpoint"].endswith(f"step-{summary['step']:06d}")
    assert complete_checkpoints(out)[-1][0] == summary["step"]

    # Continue the same run, then kill -9 it while it checkpoints every step.
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv3", "train", "--resume", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _wait_for_steps(out, proc, summary["step"] + 4)
    time.sleep(0.013)
    proc.kill()
    proc.wait(timeout=60)
    found = complete_checkpoints(out)
    assert found and found[-1][0] > summary["step"]
    for _, folder in found:
        model = dsv3.load_pretrained(folder)
        assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    last = found[-1][0]
    opts = TrainOptions.load(out)
    opts.steps = last + 2
    resumed = run_training(opts, resume=True, show_progress=False, plots=False)
    assert resumed["step"] == last + 2 and resumed["stopped"] == "completed"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # leftovers cleaned
