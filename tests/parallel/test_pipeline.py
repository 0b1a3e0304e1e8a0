"""Pipeline parallelism: the stage plan, the balance-loss gradient injection, micro-batch weighting (in one
process, with unlabelled positions), and training on gloo processes with every schedule, pp x dp included,
step for step equal to one process; a rank that fails stops the others with a clear error."""

import importlib.util
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.model.transformer import Transformer
from dsv3.parallel.pipeline import (
    IGNORE_INDEX,
    SCHEDULES,
    StageModule,
    StepTally,
    balanced_layers,
    inject_aux_loss,
    label_counts,
    plan_pipeline,
)
from dsv3.parallel.pipeline_bench import SavedBytes
from dsv3.testing.launch import launch
from dsv3.testing.pipeline_scenarios import PipeSpec, pipeline_worker, single_process_run, spec_config

# One launch for all (starting processes costs more than the steps): every schedule on 2 pipeline ranks
# x 2 data-parallel replicas, DualPipeV on 4 pipeline ranks alone, and DualPipeV with its OVERLAP_F_B
# pairs run by the registered custom function.
SPECS = [PipeSpec(schedule, pp=2, dp=2) for schedule in SCHEDULES] + [
    PipeSpec("dualpipev", pp=4, layers=7, microbatches=8),
    PipeSpec("dualpipev", pp=4, layers=7, microbatches=8, overlap=True),
]
IDS = [f"pp2xdp2-{schedule}" for schedule in SCHEDULES] + ["pp4-dualpipev", "pp4-dualpipev-overlap-f-b"]


# ---- the plan ------------------------------------------------------------------------------------


def test_balanced_layers_count_the_mtp_layer_in_the_last_stage():
    assert balanced_layers(3, 1, 2) == (2, 1)
    assert balanced_layers(3, 1, 4) == (1, 1, 1, 0)  # the last stage: MTP layer + head
    assert balanced_layers(2, 1, 4) == (1, 1, 0, 0)
    assert balanced_layers(61, 1, 16) == (4,) * 14 + (3, 2)  # V3: 61 layers + MTP on 16 stages
    assert sum(balanced_layers(7, 1, 8)) == 7


def test_plan_maps_stages_to_ranks_as_the_schedules_do(tiny_train_config):
    cfg = tiny_train_config.replace(num_hidden_layers=7)
    v = plan_pipeline(cfg, 4, "dualpipev", 8)
    assert [v.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_on(0) == [0, 7] and v.num_stages == 8
    loop = plan_pipeline(cfg, 2, "interleaved", 4, stages_per_rank=3)
    assert loop.stages_on(1) == [1, 3, 5] and loop.num_stages == 6
    custom = plan_pipeline(cfg, 2, "1f1b", 2, layers_per_stage=[5, 2])
    assert custom.layer_range(1) == range(5, 7)
    assert plan_pipeline(cfg, 2, "zbv").microbatches == 8  # default: twice the stages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ranks=2, schedule="gpipe"), "must be one of"),
        (dict(ranks=1, schedule="1f1b"), "at least 2 pipeline ranks"),
        (dict(ranks=2, schedule="1f1b", layers_per_stage=[1, 1]), "add up to the 3 layers"),
        (dict(ranks=2, schedule="1f1b", layers_per_stage=[3]), "2 stages need 2 numbers"),
        (dict(ranks=4, schedule="dualpipev"), "would hold no layer"),
        (dict(ranks=2, schedule="zbv", stages_per_rank=3), "runs 2 stage(s) per rank"),
        (dict(ranks=2, schedule="1f1b", microbatches=0), "at least 1"),
        (dict(ranks=2, schedule="dualpipev", microbatches=3), "at least as many micro-batches as stages (4)"),
        (dict(ranks=2, schedule="interleaved", microbatches=5), "a multiple of 2"),
    ],
)
def test_plan_refuses_impossible_layouts(tiny_train_config, kwargs, message):
    with pytest.raises(DSV3Error, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_pipeline(tiny_train_config.replace(num_hidden_layers=3), **kwargs)


# ---- the balance loss and the micro-batch weights, in one process --------------------------------


def test_inject_aux_loss_is_identity_forward_and_gives_aux_its_weight():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    aux = (w**2).sum()
    y = inject_aux_loss(x, aux, 0.25)
    assert torch.equal(y, x)
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert torch.allclose(w.grad, 0.25 * 2 * w)  # d(0.25 * aux)/dw


def _run_stages_in_one_process(model, plan, input_ids, labels):
    """The schedule's work without its runtime: every micro-batch through every stage, each stage's input
    a fresh leaf (as received from a peer), then backward from the last stage to the first."""
    tally = StepTally()
    stages = [StageModule(model, plan, s, tally) for s in range(plan.num_stages)]
    tally.start(label_counts(labels, len(model.mtp_layers)), input_ids.shape[0])
    for ids, lab in zip(input_ids.chunk(plan.microbatches), labels.chunk(plan.microbatches), strict=True):
        x, chain = ids, []
        for stage in stages:
            x_in = x if stage.first else x.detach().requires_grad_()
            x = stage(x_in, tokens=ids, labels=lab)
            chain.append((x_in, x))
        grad = None
        for x_in, out in reversed(chain):
            out.backward(grad)
            grad = x_in.grad
    return tally.parts.tolist()


def test_stages_with_weighted_micro_batches_equal_the_whole_batch_loss(tiny_train_config):
    """Unlabelled positions spread unevenly over micro-batches: weighting each micro-batch by its share of
    the labelled tokens (per MTP depth) and of the sequences gives the whole batch's loss and gradients."""
    cfg = spec_config(tiny_train_config, PipeSpec("1f1b", pp=2))
    torch.manual_seed(0)
    reference = Transformer(cfg).train()
    model = Transformer(cfg).train()
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, cfg.vocab_size, (6, 10))
    labels = torch.randint(0, cfg.vocab_size, (6, 10))
    labels[0, :7] = IGNORE_INDEX  # micro-batch 0 has few labels
    labels[3, 5:] = IGNORE_INDEX
    out = reference.loss(input_ids, labels)
    out.loss.backward()
    plan = plan_pipeline(cfg, 2, "interleaved", microbatches=3)  # 4 stages, every stage boundary crossed
    lm, mtp, balance = _run_stages_in_one_process(model, plan, input_ids, labels)
    assert lm == pytest.approx(float(out.lm_loss.detach()), rel=1e-5)
    assert mtp == pytest.approx(float(out.mtp_loss.detach()), rel=1e-5)
    assert balance == pytest.approx(float(out.balance_loss.detach()), rel=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-6), name
    gate = reference.model.layers[1].mlp.gate.weight
    assert gate.grad.abs().sum() > 0  # the router gets the balance loss's gradient
    assert torch.equal(model.model.layers[1].mlp.expert_load, reference.model.layers[1].mlp.expert_load)


# ---- on gloo processes ---------------------------------------------------------------------------


def _check_against_one_process(base, spec, results):
    """Rank 0's global loss parts equal one process's step for step (relative 1e-5); every parameter
    and router bias held by any rank equals the single-process one after the last step."""
    reference = single_process_run(base, spec)
    losses = np.array(results[0]["losses"])  # [steps, (total, lm, mtp, balance, grad norm)]
    expected = np.array(reference["losses"])
    assert losses.shape == (spec.steps, 5)
    assert np.all(np.abs(losses[:, :4] - expected[:, :4]) <= 1e-5 * np.abs(expected[:, :4])), spec
    assert np.all(np.abs(losses[:, 4] - expected[:, 4]) <= 1e-4 * expected[:, 4]), spec  # clipping on
    held = set()
    for rank_result in results:
        for name, value in rank_result["state"].items():
            held.add(name)
            assert np.allclose(value, reference["state"][name], rtol=1e-4, atol=1e-4), (spec.schedule, name)
    assert held == set(reference["state"])  # every tensor lives on some rank
    biases = [name for name in held if name.endswith("e_score_correction_bias")]
    assert len(biases) == spec.layers and max(np.abs(reference["state"][n]).max() for n in biases) > 0  # they moved
    return float(np.max(np.abs(losses[:, :4] - expected[:, :4]) / np.abs(expected[:, :4])))


@pytest.fixture(scope="module")
def runs(tiny_train_config):
    return launch(pipeline_worker, 4, (tiny_train_config, SPECS), timeout_s=150)


@pytest.mark.parametrize("index", range(len(SPECS)), ids=IDS)
def test_pipeline_trains_like_one_process(tiny_train_config, runs, index):
    spec = SPECS[index]
    results = [r[index] for r in runs]
    _check_against_one_process(tiny_train_config, spec, results)
    expected_stages = {"1f1b": [[0], [1]], "interleaved": [[0, 2], [1, 3]], "zbv": [[0, 3], [1, 2]],
                       "dualpipev": [[0, 3], [1, 2]]}
    total = sum(p.numel() for p in Transformer(spec_config(tiny_train_config, spec)).parameters())
    assert all(r["parameter_count"] == total for r in results)  # tied copies counted once
    # a rank holds its stages only: the pruned model as a whole refuses, naming where a module lives
    assert all(re.fullmatch(r"model\.\S+ lives on pipeline rank \d, not on this one", r["whole_model_call"])
               for r in results), [r["whole_model_call"] for r in results]
    if spec.pp == 2:
        assert [r["stages"] for r in results] == expected_stages[spec.schedule] * 2
        # MoE layers on both pipeline ranks; under 1F1B/interleaved both end ranks hold the embedding
        # (kept equal by the tied-gradient sum), under the V schedules one rank holds it once
        assert all(any("mlp.experts" in name for name in r["state"]) for r in results)
        holders = sum("model.embed_tokens.weight" in r["state"] for r in results[:2])
        assert holders == (2 if spec.schedule in ("1f1b", "interleaved") else 1)
    else:
        assert [r["stages"] for r in results] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # the overlap seam: every OVERLAP_F_B pair of DualPipeV went through the registered function
    pairs = [r["overlapped_pairs"] for r in results]
    assert (min(pairs) > 0) if spec.overlap else (max(pairs) == 0)


def test_a_failing_rank_stops_the_pipeline_with_a_clear_error(tiny_train_config):
    spec = PipeSpec("1f1b", pp=2, steps=2, fail_rank=1)
    start = time.monotonic()
    with pytest.raises(DSV3Error, match=r"rank 1: pipeline rank 1 \(stage 1\): RuntimeError: injected failure"):
        launch(pipeline_worker, 2, (tiny_train_config, [spec]), timeout_s=60)
    assert time.monotonic() - start < 60  # rank 0, blocked in a receive, was stopped, not waited for


# ---- the bubble benchmark's arithmetic and its bad input -----------------------------------------


def test_saved_bytes_count_what_autograd_holds():  # the bubble formulas: tests/test_pipeline_bubble.py
    w = torch.nn.Parameter(torch.randn(8, 8))
    saved = SavedBytes([w])
    x = torch.randn(4, 8, requires_grad=True)
    with saved.counting():
        y = (x @ w).relu()  # saves x (128 B) and the relu output (128 B); w is a parameter, not counted
    assert saved.live == saved.peak == 256
    y.sum().backward()
    del y
    assert saved.live == 0 and saved.peak == 256


def test_bubble_benchmark_refuses_an_impossible_layout_before_starting(monkeypatch, capsys):
    path = Path(__file__).parents[2] / "benchmarks" / "pipeline_bubble.py"
    spec = importlib.util.spec_from_file_location("pipeline_bubble", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["pipeline_bubble.py", "--schedules", "dualpipev", "--micro-batches", "3"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [
        "error: --pp-schedule dualpipev needs at least as many micro-batches as stages (4), got 3"
    ]
