"""Resume across layouts (real gloo processes): a sharded (DCP) checkpoint written under one layout continues
under another, resharded on load, with the uninterrupted one-process run's losses (fp32 rounding), gradient
norms and expert loads: a pipeline run stopped by SIGTERM (every rank exits 0 after one checkpoint) continues
in one process. The resume matrix over six layouts is tests/train/test_train_resume_matrix.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv3.train.checkpoints import complete_checkpoints
from dsv3.train.cli import _options
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training

CONSTANT_LR = ("--warmup", "0", "--min-lr-ratio", "1.0")  # a longer --steps then keeps the same schedule


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config, corpus_dir, cache_dir):
    """The uninterrupted one-process run: 8 steps at a constant learning rate."""
    from dsv3.train.options import TrainOptions

    out = tmp_path_factory.mktemp("reference") / "run"
    opts = TrainOptions(config=str(tiny_config), data=[str(corpus_dir)], out=str(out), steps=8, batch_size=4,
                        seq_len=32, lr=3e-3, warmup=0, min_lr_ratio=1.0, save_every=100, eval_every=100,
                        eval_tokens=128, cache_dir=str(cache_dir), device="cpu", val_fraction=0.1)
    run_training(opts, show_progress=False, plots=False)
    return out


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_rows(Path(run) / "metrics.jsonl") if r["kind"] == "train"]


def assert_follows(reference: Path, run: Path) -> None:
    """``run``'s train rows are the first ones of the reference run's, to fp32 rounding."""
    got = _train_rows(run)
    want = _train_rows(reference)[: len(got)]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, len(got) + 1))
    for a, b in zip(want, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        assert b["expert_load"] == a["expert_load"], a["step"]


def _resume_in_one_process(run: Path, steps: int, **layout) -> dict:
    opts = _options({"steps": steps, **layout}, str(run))
    return run_training(opts, resume=True, show_progress=False, plots=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str], world: int) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m dsv3 ARGV`` started by hand (as a cluster scheduler would), so that the
    test can signal each one."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world)}
    return [subprocess.Popen([sys.executable, "-m", "dsv3", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(world)]


def _wait_for_rows(run: Path, procs: list[subprocess.Popen], rows: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and sum(1 for _ in metrics.open()) >= rows:
            return
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        time.sleep(0.02)
    for p in procs:
        p.kill()
    raise AssertionError("training did not reach the expected step in time")


def test_sigterm_stops_every_pipeline_rank_with_one_checkpoint_that_one_process_continues(
        reference, train_argv, tmp_path):
    run = tmp_path / "pp2"
    procs = _launch(train_argv(run, "--steps", "1000", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "1000",
                               "--eval-every", "1000", "--pp", "2"), world=2)
    try:
        _wait_for_rows(run, procs, 2)
        for p in procs:  # a scheduler's preemption signals every rank
            p.send_signal(signal.SIGTERM)
        errors = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errors]
    (step, folder), = complete_checkpoints(run)  # the stop wrote exactly one checkpoint
    assert 2 <= step <= 6 and not (folder / "model.safetensors").exists()  # no export before the end
    assert (folder / "dcp" / "__1_0.distcp").exists()  # each stage's rank wrote its own tensors
    resumed = _resume_in_one_process(run, step + 2, pp=1)
    assert resumed["step"] == step + 2
    assert_follows(reference, run)
