"""A tiny Transformer made expert-parallel with `apply_expert_parallel` trains on 4 gloo processes
(2 nodes x 2) like the same model in one process: same losses step by step, same router biases."""

import pytest

from dsv3.testing.ep_scenarios import TrainSpec, trains_worker
from dsv3.testing.launch import launch

SPECS = [
    TrainSpec(gpus_per_node=2, steps=3, dispatch="fp32", combine="fp32"),
    TrainSpec(gpus_per_node=2, steps=3, dispatch="fp8", combine="bf16"),
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
