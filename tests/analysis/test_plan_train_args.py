"""`dsv3 plan train` prints the `dsv3 train` flags of the layout it plans, and the trainer reads them back as
that layout: its own option parsing (the click command of `dsv3 train`) turns them into the same pipeline,
data-parallel, expert-parallel and sharding degrees on a world of as many processes as the plan's GPUs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import typer

from dsv3.analysis.plan import paper_setup, plan_train, planned_layout
from dsv3.cli import main
from dsv3.train.cli import _options
from dsv3.train.cli import app as train_app
from dsv3.train.distributed import World, training_layout

PAPER_FLAGS = ["--pp", "16", "--pp-schedule", "dualpipev", "--micro-batches", "120", "--ep", "64",
               "--gpus-per-node", "8", "--dp-shard", "zero1"]


def trainer_layout(flags: list[str], world_size: int):
    """The layout `dsv3 train FLAGS` builds under torchrun on ``world_size`` processes: click parses the flags
    (an unknown flag or a bad value raises), the trainer's options check them, `training_layout` places them."""
    ctx = typer.main.get_command(train_app).make_context("train", list(flags))
    given = {k: v for k, v in ctx.params.items() if k not in ("resume", "json_out")}
    opts = _options({**given, "data": given["data"] or None}, None)
    layout = training_layout(opts, World(rank=0, size=world_size, local_rank=0, device=torch.device("cpu")))
    return layout.check(world_size)


def test_plan_json_carries_the_train_flags_and_says_dualpipe_runs_as_dualpipev(capsys):
    assert main(["plan", "train", "--pp", "16", "--ep", "64", "--json"]) == 0
    table4 = json.loads(capsys.readouterr().out)
    assert table4["train_args"] == PAPER_FLAGS and "DualPipeV" in table4["train_args_note"]
    assert main(["plan", "train", "--pp", "16", "--ep", "64", "--pp-schedule", "dualpipev", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["train_args"] == PAPER_FLAGS and v["train_args_note"] is None
    assert v["layout"]["schedule"] == "dualpipev" and v["micro_batches"] == 120


def test_plan_prints_the_train_flags(capsys):
    assert main(["plan", "train", "--pp", "16", "--ep", "64", "--pp-schedule", "dualpipev"]) == 0
    assert f"dsv3 train flags: {' '.join(PAPER_FLAGS)}\n" in capsys.readouterr().out


@pytest.mark.parametrize("pp, ep, shard, schedule", [(2, 2, "zero1", "dualpipev"), (2, 1, "zero1", "1f1b"),
                                                     (1, 4, "fsdp", "1f1b"), (2, 2, "none", "dualpipe"),
                                                     (4, 1, "zero1", "1f1b"), (2, 1, "fsdp", "1f1b")])
def test_the_trainer_reads_a_plans_flags_as_its_layout_on_4_processes(pp, ep, shard, schedule):
    """V3 planned on 4 H800s (it does not fit, but the flags are the layout's all the same)."""
    arch, cluster, *_ = paper_setup()
    plan = plan_train(arch, replace(cluster, gpus=4), planned_layout(4, pp, ep, shard, schedule), 512, 16)
    got = trainer_layout(plan.train_args, 4)
    assert (got.pp, got.dp, got.ep) == (pp, 4 // pp, ep)
    assert got.dp_shard == (shard if pp < 4 else "none")  # ZeRO-1 over one replica is no sharding
    if pp > 1:
        assert (got.schedule, got.microbatches) == ("dualpipev" if schedule == "dualpipe" else schedule,
                                                    plan.micro_batches)
    assert got.gpus_per_node == (min(ep, cluster.domain) if ep > 1 else 2)  # 2: the trainer's default


def test_the_trainer_reads_the_paper_plans_flags_on_2048_processes():
    arch, cluster, layout, seq, batch = paper_setup()
    flags = plan_train(arch, cluster, layout, seq, batch).train_args
    got = trainer_layout(flags, 2048)
    assert (got.pp, got.dp, got.ep, got.dp_shard, got.gpus_per_node, got.schedule, got.microbatches) == \
        (16, 128, 64, "zero1", 8, "dualpipev", 120)


def test_an_unknown_flag_is_refused_by_the_trainer_parser():
    with pytest.raises(Exception, match="No such option"):
        trainer_layout(["--pipeline", "2"], 4)


def test_one_gpu_nodes_reach_the_trainer():
    """GPUs without a scale-up domain (one per node): the EP group spans EP nodes of one GPU each."""
    arch, cluster, *_ = paper_setup()
    one_per_node = replace(cluster, gpus=4, network="ft2", knobs=replace(cluster.knobs, scale_up_domain=1))
    plan = plan_train(arch, one_per_node, planned_layout(4, 1, 4, "zero1", "1f1b"), 512, 16)
    assert trainer_layout(plan.train_args, 4).gpus_per_node == 1
