"""Shared fixtures for the training tests: a tiny V3 config (2 layers, 8 experts) and a tiny corpus,
so every run takes a fraction of a second per step on one CPU core."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3.train.options import TrainOptions

WORDS = (
    "the quick brown fox jumps over a lazy dog while def class return import print value "
    "for in range if else lambda yield"
).split()


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory, tiny_train_config) -> Path:
    cfg = tiny_train_config
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg.save_json(path)
    return path


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(16):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(30))
        (root / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def tiny_train_argv(tiny_config: Path, corpus_dir: Path, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    """`dsv3 train` arguments for a tiny run on the tiny corpus (what the CLI and signal tests share)."""
    return [
        "train", "--config", str(tiny_config), "--data", str(corpus_dir), "--out", str(out),
        "--cache-dir", str(cache_dir), "--device", "cpu", "--batch-size", "4", "--seq-len", "32",
        "--eval-tokens", "128", "--val-fraction", "0.1", *extra,
    ]


@pytest.fixture
def train_argv(tiny_config, corpus_dir, cache_dir):
    """train_argv(out, *extra): tiny_train_argv bound to this session's config, corpus and cache."""
    return lambda out, *extra: tiny_train_argv(tiny_config, corpus_dir, cache_dir, out, *extra)


def torchrun_train(nproc: int, args: list[str]) -> dict:
    """`torchrun --standalone --nproc-per-node N -m dsv3 ARGS --json` (ARGS start with "train"; one thread
    per process); returns rank 0's JSON summary."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "dsv3", *args, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # only rank 0 prints


@pytest.fixture
def torchrun():
    return torchrun_train


@pytest.fixture
def make_opts(tiny_config, corpus_dir, cache_dir, tmp_path):
    def make(name: str = "run", **overrides) -> TrainOptions:
        base = dict(
            config=str(tiny_config),
            data=[str(corpus_dir)],
            out=str(tmp_path / name),
            steps=6,
            batch_size=4,
            seq_len=32,
            lr=3e-3,
            save_every=3,
            eval_every=3,
            eval_tokens=128,
            cache_dir=str(cache_dir),
            device="cpu",
            val_fraction=0.1,
        )
        base.update(overrides)
        return TrainOptions(**base)

    return make


@pytest.fixture
def same_training_as():
    """A check that a parallel run's train rows and final checkpoint are the single-process run's: losses
    (relative 1e-5), gradient norms (1e-4), expert loads exactly, and the saved model's logits (1e-4)."""

    def check(single_out: str | Path, parallel_out: str | Path) -> None:
        import torch

        import dsv3
        from dsv3.train.metrics import read_rows

        one = [r for r in read_rows(Path(single_out) / "metrics.jsonl") if r["kind"] == "train"]
        two = [r for r in read_rows(Path(parallel_out) / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["step"] for r in one] == [r["step"] for r in two]
        for a, b in zip(one, two, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
            assert a["expert_load"] == b["expert_load"]
        ref = dsv3.load_pretrained(Path(single_out) / "latest")
        got = dsv3.load_pretrained(Path(parallel_out) / "latest")  # one ordinary folder with every expert
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(got(ids), ref(ids), rtol=1e-4, atol=1e-4)

    return check
