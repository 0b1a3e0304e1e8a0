"""A tiny Transformer made expert-parallel with `parallelize` trains on 4 gloo processes (2 nodes x 2) like
the same model in one process: same losses step by step, same router biases; and the trainer's own
`build_model` for `--ep 4 --precision fp8` computes the sharded experts in FP8."""

import pytest

from dsv3.testing.ep_scenarios import TrainSpec, trains_worker
from dsv3.testing.launch import launch

SPECS = [
    TrainSpec(gpus_per_node=2, steps=3, dispatch="fp32", combine="fp32"),
    TrainSpec(gpus_per_node=2, steps=3, dispatch="fp8", combine="bf16"),
    TrainSpec(gpus_per_node=2, steps=3, precision="fp8"),
    TrainSpec(gpus_per_node=2, steps=2, seqs_per_rank=2, micro_batches=2, dispatch="fp32", combine="fp32"),
]


@pytest.fixture(scope="module")
def runs():
    return launch(trains_worker, 4, (SPECS,), timeout_s=120)[0]


def test_ep_training_matches_single_process(runs):
    exact = runs[0]
    assert len(exact["ep_losses"]) == 3
    for ep, single in zip(exact["ep_losses"], exact["single_losses"], strict=True):
        assert abs(ep - single) <= 1e-5 * abs(single)
    assert exact["ep_losses"][-1] < exact["ep_losses"][0] - 0.1  # it learns the fixed batch
    # the aux-free bias update saw the global loads: same biases as one process, and they moved
    assert exact["bias_max_abs"] > 0
    assert exact["bias_max_abs_diff"] <= 1e-6


def test_ep_training_with_fp8_dispatch_bf16_combine_stays_close(runs):
    for ep, single in zip(runs[1]["ep_losses"], runs[1]["single_losses"], strict=True):
        assert abs(ep - single) <= 1e-2 * abs(single)


def test_ep_training_with_fp8_precision_uses_fp8_experts(runs):
    """`dsv3 train --ep 4 --precision fp8` once kept the sharded experts in high precision, silently."""
    fp8 = runs[2]
    assert fp8["expert_kinds"] == ["FP8Experts"]
    assert fp8["expert_forward_calls"] == 3 * 2  # 3 steps x 2 MoE layers (layer 1 and the MTP layer)
    for ep, single in zip(fp8["ep_losses"], fp8["single_losses"], strict=True):
        assert abs(ep - single) <= 1e-2 * abs(single)  # FP8 dispatch on the wire; FP8 GEMMs on both sides


def test_ep_training_with_gradient_accumulation_matches_single_process(runs):
    """Micro-batches under expert parallelism (the trainer's --grad-accum with --ep once failed: its
    no_sync belonged to DDP); the layout object's no_sync lets gradients accumulate and sync once."""
    accumulated = runs[3]
    for ep, single in zip(accumulated["ep_losses"], accumulated["single_losses"], strict=True):
        assert abs(ep - single) <= 1e-5 * abs(single)
    assert accumulated["bias_max_abs_diff"] <= 1e-6
