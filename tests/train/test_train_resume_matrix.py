"""Any layout resumes any other (real gloo processes, `dsv3 train --resume` as a user runs it): two chains of
one-step segments walk six layouts in two orders, so that a checkpoint saved under each of {1 process, ep2,
fsdp dp2, pp2 x ep2 (1F1B), ep4 x fsdp, pp2 x DualPipeV x zero1} continues under two others, among them
pp2 x ep2 -> ep4 x fsdp and fsdp -> pp2 x ep2. Every step's loss, gradient norm and expert loads equal the
uninterrupted one-process run's (fp32 rounding; loads exactly). The second chain ends with a resume that
names no layout on one process, which cannot hold pp2 x ep2: it takes the nearest layout that fits and
says so. (tests/train/test_train_reshard.py stops a pipeline run by SIGTERM and continues it in one process.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training

# The layouts' flags; a resume names every layout flag so that none is kept from the previous layout.
ONE = ("--pp", "1", "--ep", "1", "--dp-shard", "none")
LAYOUTS = {
    "one": (1, ONE),
    "ep2": (2, ("--pp", "1", "--ep", "2", "--dp-shard", "none")),
    "fsdp": (2, ("--pp", "1", "--ep", "1", "--dp-shard", "fsdp")),
    "pp2-ep2": (4, ("--pp", "2", "--pp-schedule", "1f1b", "--ep", "2", "--dp-shard", "none")),
    "ep4-fsdp": (4, ("--pp", "1", "--ep", "4", "--dp-shard", "fsdp")),
    "pp2-dualpipev-zero1": (4, ("--pp", "2", "--pp-schedule", "dualpipev", "--ep", "1", "--dp-shard", "zero1")),
}
# Each layout is followed by a different one in each chain (every saved layout resumes under two others).
CHAINS = {
    "a": ["one", "ep2", "fsdp", "pp2-ep2", "ep4-fsdp", "pp2-dualpipev-zero1", "one"],
    "b": ["one", "pp2-dualpipev-zero1", "ep4-fsdp", "fsdp", "ep2", "pp2-ep2", None],  # None: no layout flags
}
STEPS = 7
COMMON = ("--batch-size", "8", "--seq-len", "32", "--lr", "3e-3", "--warmup", "0", "--min-lr-ratio", "1.0",
          "--save-every", "1", "--eval-every", "100", "--eval-tokens", "128", "--keep-last", "1")


@pytest.fixture(scope="module")
def config3(tmp_path_factory, tiny_train_config):
    """The tiny config with 3 layers (+1 MTP): four pipeline stages of one block each for DualPipeV on 2."""
    path = tmp_path_factory.mktemp("cfg3") / "config.json"
    tiny_train_config.replace(num_hidden_layers=3).save_json(path)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, config3, corpus_dir, cache_dir):
    """The uninterrupted one-process run of STEPS steps."""
    out = tmp_path_factory.mktemp("reference") / "run"
    _cli(1, _first_args(config3, corpus_dir, cache_dir, out, STEPS))
    return out


def _first_args(config, corpus, cache, out: Path, steps: int) -> list[str]:
    return ["train", "--config", str(config), "--data", str(corpus), "--out", str(out), "--steps", str(steps),
            "--cache-dir", str(cache), "--device", "cpu", "--val-fraction", "0.1", "--threads", "1", *COMMON]


def _cli(world: int, args: list[str]) -> tuple[dict, str]:
    """``dsv3 ARGS --json`` on ``world`` processes (torchrun above one); rank 0's summary and the stderr."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
    proc = subprocess.run([sys.executable, *launcher, "-m", "dsv3", *args, "--json"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_rows(run / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_every_layout_resumes_under_two_others_with_the_one_process_losses(chain, reference, config3, corpus_dir,
                                                                           cache_dir, tmp_path):
    run = tmp_path / chain
    layouts = CHAINS[chain]
    stderr = ""
    for step, name in enumerate(layouts, start=1):
        if step == 1:
            summary, _ = _cli(1, _first_args(config3, corpus_dir, cache_dir, run, 1))
            continue
        world, flags = LAYOUTS[name] if name is not None else (1, ())
        summary, stderr = _cli(world, ["train", "--resume", str(run), "--steps", str(step), *flags])
        assert summary["step"] == step and summary["world_size"] == world, name
    got, want = _train_rows(run), _train_rows(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b, name in zip(want, got, layouts, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], name)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a["step"], name)
        assert b["expert_load"] == a["expert_load"], (a["step"], name)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    exported, expected = dsv3.load_pretrained(run / "latest"), dsv3.load_pretrained(reference / "latest")
    torch.testing.assert_close(exported(ids), expected(ids), rtol=1e-4, atol=1e-4)  # one folder, every expert
    if layouts[-1] is None:  # the last resume named no layout: it says what it chose, and run.json has it
        assert "does not fit 1 process(es); resuming as dp=1, ep=1, dp_shard=none" in stderr
        saved = json.loads((run / "run.json").read_text())
        assert (saved["pp"], saved["ep"]) == (None, None)


def test_a_resume_without_layout_flags_keeps_a_layout_that_fits(make_opts):
    """Nothing to choose when the saved layout fits the world: run.json's layout stays as it was."""
    opts = make_opts("fits", steps=1, save_every=1, eval_every=100, dp_shard="none", ep=None)
    run_training(opts, show_progress=False, plots=False)
    before = json.loads((Path(opts.out) / "run.json").read_text())
    from dsv3.train.cli import _options

    summary = run_training(_options({"steps": 2}, opts.out), resume=True, show_progress=False, plots=False,
                           fit_layout=True)
    after = json.loads((Path(opts.out) / "run.json").read_text())
    assert summary["step"] == 2
    assert {k: after[k] for k in LAYOUT_KEYS} == {k: before[k] for k in LAYOUT_KEYS}


LAYOUT_KEYS = ("pp", "ep", "dp_shard", "pp_schedule", "microbatches", "gpus_per_node")
