"""`dsv3 train --ac selective|full` (activation checkpointing) computes what `--ac none` computes, bit for bit
(losses, gradient norms, expert loads, the trained weights), keeping fewer activations (run.json's
``activations_peak``: full < selective < none); under 2 gloo processes `--ac full` trains with expert
parallelism, pipeline stages and FSDP like one process, and FP8 under EP like `--ac none` bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.testing.launch import launch
from dsv3.testing.sharding_scenarios import train_worker
from dsv3.train.metrics import read_rows
from dsv3.train.options import TrainOptions, resumed_options
from dsv3.train.run import run_training

STEPS = 3
TIMING = ("step_seconds", "tokens_per_s", "elapsed", "time")  # the only fields that may differ


@pytest.fixture(scope="module")
def base_options(tiny_config, corpus_dir, cache_dir) -> dict:
    return dict(config=str(tiny_config), data=[str(corpus_dir)], steps=STEPS, batch_size=4, seq_len=32, lr=3e-3,
                save_every=STEPS, eval_every=STEPS, eval_tokens=128, cache_dir=str(cache_dir), device="cpu",
                val_fraction=0.1)


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, base_options) -> dict[str, Path]:
    """One process, each --ac mode: 3 steps, an evaluation and a checkpoint at the end."""
    root = tmp_path_factory.mktemp("ac")
    for mode in ("none", "selective", "full"):
        run_training(TrainOptions(**base_options, out=str(root / mode), ac=mode), show_progress=False, plots=False)
    return {mode: root / mode for mode in ("none", "selective", "full")}


def _rows(run_dir: Path) -> list[dict]:
    """The metrics rows without their timings."""
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)}
            for row in read_rows(run_dir / "metrics.jsonl")]


def _memory(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "run.json").read_text())["memory"]["per_rank"]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputing_trains_bit_for_bit_like_keeping_everything(mode, single_runs):
    none, ac = _rows(single_runs["none"]), _rows(single_runs[mode])
    assert [r["kind"] for r in ac] == ["train"] * STEPS + ["eval"]
    assert ac == none  # losses, gradient norms, expert loads (a recomputation counts no token twice), eval
    want = dsv3.load_pretrained(single_runs["none"] / "latest").state_dict()
    got = dsv3.load_pretrained(single_runs[mode] / "latest").state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name  # every gradient was the same, every step


def test_recomputing_keeps_fewer_activations(single_runs):
    peak = {mode: _memory(run)[0]["activations_peak"] for mode, run in single_runs.items()}
    assert 0 < peak["full"] < 0.5 * peak["selective"] and peak["selective"] < 0.8 * peak["none"], peak
    others = {mode: {k: v for k, v in _memory(run)[0].items() if k != "activations_peak"}
              for mode, run in single_runs.items()}
    assert others["none"] == others["selective"] == others["full"]  # parameters, gradients, optimizer state
    assert json.loads((single_runs["full"] / "run.json").read_text())["ac"] == "full"


def test_ac_is_checked_and_may_change_on_resume(make_opts):
    with pytest.raises(DSV3Error, match="--ac must be one of none, selective, full, got 'some'"):
        make_opts(ac="some").check()
    saved = make_opts(ac="none")
    assert resumed_options(saved, {"ac": "full"}).ac == "full"  # memory, not results: a resume may change it


def test_cli_refuses_an_unknown_ac_with_one_error_line(train_argv, tmp_path, capsys):
    from dsv3.cli import main

    assert main(train_argv(tmp_path / "bad", "--ac", "partial")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --ac must be one of none, selective, full, got 'partial'"]
    assert not (tmp_path / "bad").exists()


# ---- 2 processes ---------------------------------------------------------------------------------------

LAYOUTS = {  # --ac full under each, compared with one process (fp32)
    "ep2": {"ep": 2},
    "pp2": {"pp": 2},
    "fsdp": {"dp_shard": "fsdp"},
}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, base_options) -> Path:
    """One launch of 2 gloo processes (the trainer as under torchrun): --ac full under each layout, and FP8
    under --ep 2 with --ac none and --ac full."""
    root = tmp_path_factory.mktemp("ac2")
    runs = [{"options": {**base_options, **extra, "ac": "full", "out": str(root / name)}}
            for name, extra in LAYOUTS.items()]
    for mode in ("none", "full"):
        options = {**base_options, "ep": 2, "precision": "fp8", "ac": mode, "out": str(root / f"fp8-ep2-{mode}")}
        runs.append({"options": options})
    summaries = launch(train_worker, 2, (runs,), timeout_s=300)
    assert [[s["step"] for s in rank] for rank in summaries] == [[STEPS] * len(runs)] * 2
    return root


@pytest.mark.parametrize("name", LAYOUTS)
def test_full_recomputation_trains_like_one_process_under_each_layout(name, single_runs, two_process_runs):
    one, two = _rows(single_runs["none"]), _rows(two_process_runs / name)
    assert [(r["kind"], r["step"]) for r in two] == [(r["kind"], r["step"]) for r in one]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "total_loss", "mtp_loss", "balance_loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (name, a["step"], key)
        if a["kind"] == "train":
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a["step"])
            assert b["expert_load"] == a["expert_load"], (name, a["step"])


def test_full_recomputation_under_fp8_and_ep_is_bit_for_bit_and_keeps_less(two_process_runs):
    none, full = two_process_runs / "fp8-ep2-none", two_process_runs / "fp8-ep2-full"
    assert _rows(full) == _rows(none)
    for kept, recomputed in zip(_memory(none), _memory(full), strict=True):
        assert 0 < recomputed["activations_peak"] < 0.5 * kept["activations_peak"], (kept, recomputed)


def test_the_meter_counts_what_a_checkpoint_region_keeps_its_inputs():
    """Inside a region torch's checkpoint saves nothing (its own hooks keep a placeholder); the region's
    inputs are saved outside it, where the meter sees them."""
    from torch.utils.checkpoint import checkpoint

    from dsv3.parallel.memory import SavedTensorMeter

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 32))
    meter = SavedTensorMeter()
    with meter.active():
        loss = checkpoint(lambda t: (t @ w).relu(), x, use_reentrant=False).sum()
    assert meter.peak == meter.live == 8 * 16 * 4  # x, not relu's output (8 x 32): that is recomputed
    loss.backward()
    assert meter.live == 0
