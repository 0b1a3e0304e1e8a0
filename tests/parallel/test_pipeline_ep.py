"""Pipeline stages x expert parallelism (``Layout(pp, dp, ep, schedule)``) on 8 gloo processes, through
`parallelize` and the trainer's calls on the object it returns: pp2 x 1F1B x EP2 (dp4) and pp2 x DualPipeV
x EP4 (dp4, its OVERLAP_F_B pairs run concurrently, and again in order) give the single-process run's
per-step losses (relative 1e-5, fp32), its router biases after training, and, gathered, its weights; pp2 x
1F1B x EP4 in fp8 trains FP8 experts next to one fp8 process. All in one 8-process launch (about 55-100 s on
the shared 2-core machine under load, most of it starting the processes)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.transformer import Transformer
from dsv3.parallel.mesh import group_ranks
from dsv3.testing.launch import launch
from dsv3.testing.pipeline_scenarios import PipeSpec, pipeline_worker, single_process_run, spec_config

# One launch (starting 8 processes costs more than the steps).
SPECS = [
    PipeSpec("1f1b", pp=2, dp=4, ep=2, microbatches=2, batch=8),
    PipeSpec("dualpipev", pp=2, dp=4, ep=4, microbatches=4, batch=16),
    PipeSpec("dualpipev", pp=2, dp=4, ep=4, microbatches=4, batch=16, concurrent=False),
    PipeSpec("1f1b", pp=2, dp=4, ep=4, microbatches=2, batch=8, steps=3, precision="fp8"),
]
IDS = ["pp2-1f1b-ep2-dp4", "pp2-dualpipev-ep4-dp4-overlapped", "pp2-dualpipev-ep4-dp4-in-order"]
FP32 = range(len(IDS))
FP8 = len(IDS)


def test_group_arithmetic_puts_ep_groups_inside_a_stage_s_replicas():
    layout = Layout(pp=2, dp=4, ep=2)  # stage-major: rank p * 4 + d is pipeline rank p of replica d
    ep = group_ranks(layout, "ep")  # stage 0's groups, then stage 1's
    assert ep[0] == [0, 1] and ep[1] == [2, 3]
    assert ep[3] == [6, 7]  # consecutive: an EP group fills whole nodes
    replicas = group_ranks(layout, "ep_replicate")
    assert replicas[0] == [0, 2] and replicas[3] == [5, 7]
    assert group_ranks(layout, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v3 = Layout(pp=16, dp=128, ep=64, gpus_per_node=8)  # 2,048 processes
    assert group_ranks(v3, "ep")[3 * 2 + 1] == list(range(3 * 128 + 64, 4 * 128))  # 8 whole nodes of stage 3


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Layout(pp=2, dp=4, ep=3), "--ep 3 must divide the number of data-parallel processes of each pipeline "
                                   "stage (processes / --pp 2) (4)"),
        (Layout(pp=2, dp=1, dp_shard="fsdp"), "--pp 2 with --dp-shard fsdp shards each stage over its "
                                              "data-parallel replicas, but there is one"),
    ],
)
def test_impossible_pipeline_ep_layouts_are_refused(layout, message):
    with pytest.raises(DSV3Error, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout.check(layout.world)


@pytest.fixture(scope="module")
def runs(tiny_train_config):
    return launch(pipeline_worker, 8, (tiny_train_config, SPECS), timeout_s=400)


@pytest.fixture(scope="module")
def references(tiny_train_config):
    return [single_process_run(tiny_train_config, spec) for spec in SPECS]


@pytest.mark.parametrize("index", FP32, ids=IDS)
def test_pipeline_with_expert_parallelism_trains_like_one_process(tiny_train_config, runs, references, index):
    spec, reference = SPECS[index], references[index]
    results = [r[index] for r in runs]
    assert {r["kind"] for r in results} == {"Parallelized"}
    losses = np.array(results[0]["losses"])  # [steps, (total, lm, mtp, balance, grad norm)]
    expected = np.array(reference["losses"])
    assert losses.shape == (spec.steps, 5)
    assert np.all(np.abs(losses[:, :4] - expected[:, :4]) <= 1e-5 * np.abs(expected[:, :4]))
    assert np.all(np.abs(losses[:, 4] - expected[:, 4]) <= 1e-4 * expected[:, 4])  # clipping on: norm global
    assert all(np.array_equal(np.array(r["losses"]), losses) for r in results)  # every rank reports the same
    # each rank holds 8 / ep experts of every MoE layer of its stages
    assert all(set(r["experts_here"]) == {8 // spec.ep} for r in results)
    biases = 0
    for r in results:  # the aux-free bias update: expert loads summed over every replica of the stage
        for name, value in r["biases"].items():
            assert np.allclose(value, reference["state"][name], rtol=0, atol=1e-6), name
            biases += 1
    assert biases == spec.dp * spec.layers and max(np.abs(v).max() for v in results[0]["biases"].values()) > 0
    full = results[0]["full_state"]  # the gathered whole model, every expert included
    assert set(full) == set(reference["state"])
    for name, value in full.items():
        # an embedding row whose gradient nearly cancels gets AdamW's full step from rounding-level
        # differences (one process and the plain pipeline differ there alike)
        tol = 5e-3 if name == "model.embed_tokens.weight" else 1e-4
        assert np.allclose(value, reference["state"][name], rtol=1e-4, atol=tol), name
    total = sum(p.numel() for p in Transformer(spec_config(tiny_train_config, spec)).parameters())
    assert {r["parameter_count"] for r in results} == {total}  # replicated once, each expert once


def test_overlapped_dualpipev_is_the_in_order_step(runs):
    """V3's overlap (one micro-batch's dispatch/combine under another's compute, two threads) changes when
    things run, not what they compute: the same losses as the in-order step, and it is the default."""
    overlapped, in_order = ([r[i] for r in runs] for i in (1, 2))
    assert {r["overlap"] for r in overlapped} == {"run_concurrently"}
    assert {r["overlap"] for r in in_order} == {"run_in_order"}
    a, b = np.array(overlapped[0]["losses"]), np.array(in_order[0]["losses"])
    assert np.allclose(a, b, rtol=1e-6, atol=0)


def test_fp8_experts_train_under_pipeline_and_ep(runs, references):
    """--precision fp8 under pp2 x EP4: FP8 linears and FP8 experts, FP8 dispatch on the wire; the losses
    stay next to one process in fp8 (its local dispatch moves no FP8 rows)."""
    results = [r[FP8] for r in runs]
    assert {kind for r in results for kind in r["expert_kinds"]} == {"FP8Experts"}
    losses, expected = np.array(results[0]["losses"])[:, :4], np.array(references[FP8]["losses"])[:, :4]
    assert np.all(np.isfinite(losses)) and np.allclose(losses, expected, rtol=1e-2, atol=0)
