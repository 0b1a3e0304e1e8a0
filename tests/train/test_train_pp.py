"""`torchrun --nproc-per-node 2 -m dsv3 train --pp 2`: two pipeline stages (1F1B, DualPipeV; and two
data-parallel replicas of them on 4 processes) train like one process (fp32: the same losses, gradient
norms and expert loads), export one ordinary HF folder that gives the single-process model's logits, and
resume from a sharded (DCP) checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training

CONSTANT_LR = ("--warmup", "0", "--min-lr-ratio", "1.0")


@pytest.fixture(scope="module")
def config3(tmp_path_factory, tiny_train_config):
    """The tiny config with 3 layers (+1 MTP): four pipeline stages of one block each for DualPipeV on 2."""
    path = tmp_path_factory.mktemp("cfg3") / "config.json"
    tiny_train_config.replace(num_hidden_layers=3).save_json(path)
    return path


@pytest.fixture
def pp_argv(train_argv, config3):
    """train_argv with the 3-layer config."""

    def argv(out, *extra):
        args = train_argv(out, *extra)
        args[args.index("--config") + 1] = str(config3)
        return args

    return argv


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, config3, corpus_dir, cache_dir):
    """The one-process reference: 5 steps at a constant learning rate (so 2 steps resumed to 4 follow it)."""
    from dsv3.train.options import TrainOptions

    out = tmp_path_factory.mktemp("single") / "run"
    opts = TrainOptions(config=str(config3), data=[str(corpus_dir)], out=str(out), steps=5, batch_size=4,
                        seq_len=32, lr=3e-3, warmup=0, min_lr_ratio=1.0, save_every=2, eval_every=2,
                        eval_tokens=128, cache_dir=str(cache_dir), device="cpu", val_fraction=0.1)
    run_training(opts, show_progress=False, plots=False)
    return out


def assert_same_rows(single: os.PathLike, other: os.PathLike) -> None:
    """``other``'s metrics rows equal the first ones of ``single`` (as many as ``other`` wrote)."""
    two = read_rows(os.path.join(other, "metrics.jsonl"))
    one = read_rows(os.path.join(single, "metrics.jsonl"))[: len(two)]
    assert [(r["kind"], r["step"]) for r in one] == [(r["kind"], r["step"]) for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "total_loss", "mtp_loss", "balance_loss", "val_loss", "val_bpb"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        if a["kind"] == "train":
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
            assert a["expert_load"] == b["expert_load"], a["step"]


def assert_same_logits(single: os.PathLike, other: os.PathLike, step: int) -> None:
    """``other``'s final model gives the logits of the single-process checkpoint of ``step``."""
    ref = dsv3.load_pretrained(os.path.join(single, "checkpoints", f"step-{step:06d}"))
    pp = dsv3.load_pretrained(os.path.join(other, "latest"))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pp(ids), ref(ids), rtol=1e-4, atol=1e-4)


def test_pp2_1f1b_run_and_resume_match_one_process(single_run, pp_argv, torchrun, tmp_path):
    out = tmp_path / "pp"
    args = ("--lr", "3e-3", *CONSTANT_LR, "--save-every", "2", "--eval-every", "2", "--pp", "2")
    first = torchrun(2, pp_argv(out, "--steps", "2", *args))
    assert first["world_size"] == 2 and first["parameters"] > 0
    assert os.path.exists(out / "checkpoints" / "step-000002" / "dcp" / "__1_0.distcp")  # rank 1 wrote its stage
    second = torchrun(2, ["train", "--resume", str(out), "--steps", "4"])
    assert second["step"] == 4
    assert_same_rows(single_run, out)
    assert_same_logits(single_run, out, 4)


def test_pp2_dualpipev_matches_one_process(single_run, pp_argv, torchrun, tmp_path):
    out = tmp_path / "dualpipev"
    summary = torchrun(2, pp_argv(out, "--steps", "4", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "2",
                                     "--eval-every", "2", "--pp", "2", "--pp-schedule", "dualpipev"))
    assert summary["step"] == 4
    assert_same_rows(single_run, out)
    assert_same_logits(single_run, out, 4)


def test_pp2_times_dp2_matches_one_process(single_run, pp_argv, torchrun, tmp_path):
    out = tmp_path / "pp2dp2"  # 4 processes: two replicas of a 2-stage pipeline, 2 sequences each
    summary = torchrun(4, pp_argv(out, "--steps", "2", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "2",
                                  "--eval-every", "2", "--pp", "2", "--micro-batches", "2"))
    assert summary["world_size"] == 4 and summary["step"] == 2
    assert_same_rows(single_run, out)


def test_pp2_times_ep2_matches_one_process(single_run, pp_argv, torchrun, tmp_path):
    """4 processes: 2 pipeline stages x 2 data-parallel replicas, each stage's routed experts split over its
    2 replicas (EP2): the train rows, expert loads and saved logits of one process."""
    out = tmp_path / "pp2ep2"
    summary = torchrun(4, pp_argv(out, "--steps", "2", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "2",
                                  "--eval-every", "2", "--pp", "2", "--micro-batches", "2", "--ep", "2",
                                  "--gpus-per-node", "1"))
    assert summary["world_size"] == 4 and summary["step"] == 2
    assert summary["parameters"] == sum(p.numel() for p in dsv3.load_pretrained(single_run / "latest").parameters())
    run = json.loads((out / "run.json").read_text())
    assert run["pp"] == 2 and run["ep"] == 2 and run["memory"]["layout"]["ep"] == 2
    assert len(run["memory"]["per_rank"]) == 4
    assert_same_rows(single_run, out)
    ref = dsv3.load_pretrained(single_run / "checkpoints" / "step-000002")  # one ordinary folder: every
    got = dsv3.load_pretrained(out / "latest")  # expert of every stage
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got(ids), ref(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ep", [1, 2], ids=["pp2-fsdp2", "pp2-fsdp2-ep2"])
def test_pp2_times_fsdp_matches_one_process_and_shards_each_stage(ep, single_run, pp_argv, torchrun, tmp_path):
    """4 processes: 2 pipeline stages, each FSDP-sharded over its 2 replicas (with --ep 2 the stage's routed
    experts split over them instead): the one process's losses of 5 steps, and per rank parameters plus
    AdamW state below the half that FSDP over 2 replicas alone leaves."""
    out = tmp_path / f"pp2fsdp-ep{ep}"
    summary = torchrun(4, pp_argv(out, "--steps", "5", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "5",
                                  "--eval-every", "2", "--pp", "2", "--micro-batches", "2", "--dp-shard", "fsdp",
                                  "--ep", str(ep), "--gpus-per-node", "1"))
    assert summary["world_size"] == 4 and summary["step"] == 5
    assert summary["parameters"] == sum(p.numel() for p in dsv3.load_pretrained(single_run / "latest").parameters())
    assert_same_rows(single_run, out)
    (ref,) = json.loads((single_run / "run.json").read_text())["memory"]["per_rank"]
    ranks = json.loads((out / "run.json").read_text())["memory"]["per_rank"]
    assert len(ranks) == 4
    for m in ranks:
        assert m["gradients"] == m["parameters"]  # the gradients sharded like the parameters
        assert m["parameters"] + m["optimizer"] < 0.4 * (ref["parameters"] + ref["optimizer"]), m
    assert_same_logits(single_run, out, 5)


def test_a_plans_train_args_run_as_dsv3_train(pp_argv, torchrun, tmp_path):
    """The `dsv3 train` flags `dsv3 plan train` gives for a 4-GPU plan (pp2 x DualPipeV x EP2 x ZeRO-1), its
    micro-batches scaled down to the test's batch, run on 4 processes as the plan's layout."""
    from dataclasses import replace

    from dsv3.analysis.plan import paper_setup, plan_train, planned_layout

    arch, cluster, *_ = paper_setup()
    plan = plan_train(arch, replace(cluster, gpus=4), planned_layout(4, 2, 2, "zero1", "dualpipev"), 512, 16)
    args = list(plan.train_args)
    args[args.index("--micro-batches") + 1] = "4"
    out = tmp_path / "planned"
    summary = torchrun(4, pp_argv(out, "--steps", "1", "--batch-size", "8", "--eval-every", "100", *args))
    assert summary["step"] == 1 and summary["world_size"] == 4
    layout = json.loads((out / "run.json").read_text())["memory"]["layout"]
    assert {k: layout[k] for k in ("pp", "dp", "ep", "dp_shard", "schedule", "gpus_per_node")} == \
        {"pp": 2, "dp": 2, "ep": 2, "dp_shard": "zero1", "schedule": "dualpipev", "gpus_per_node": 2}


def test_pp_without_enough_processes_is_refused(make_opts):
    with pytest.raises(DSV3Error, match="--pp 2 needs a multiple of 2 processes"):
        run_training(make_opts("pp1", pp=2), show_progress=False, plots=False)
    with pytest.raises(DSV3Error, match="--pp-schedule must be one of"):
        make_opts("bad", pp=2, pp_schedule="gpipe").check()
    make_opts("ep", pp=2, ep=2).check()  # pipeline stages with EP: the layout checks E | D (test_parallelize)
    make_opts("zero1", pp=2, dp_shard="zero1").check()  # pipeline stages x ZeRO-1 (test_pipeline_zero1)
    with pytest.raises(DSV3Error, match="they need --pp 2 or more"):
        make_opts("nopp", microbatches=4).check()
