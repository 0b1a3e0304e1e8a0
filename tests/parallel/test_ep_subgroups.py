"""Expert parallelism over part of the data-parallel ranks (``Layout(dp=4, ep=2)``: two EP groups of two
ranks, every expert held twice) on 4 gloo processes trains like one process: same losses and clipped grad
norms step by step, same router biases, replicas that stay equal, a full checkpoint that loads with
`dsv3.load_pretrained` and gives the single-process logits. Both the one-node EP group (gpus_per_node 2)
and the two-node one (gpus_per_node 1, a real inter-node hop) run. The 8-process dp8 x ep4 layout is the
same code and took 35 s on two cores, so it runs only with DSV3_TEST_EP8=1."""

from __future__ import annotations

import os

import pytest

from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.parallel.mesh import group_ranks
from dsv3.testing.ep_subgroup_scenarios import SubgroupSpec, subgroup_trains_worker
from dsv3.testing.launch import launch

SPECS = [SubgroupSpec(ep=2, gpus_per_node=1), SubgroupSpec(ep=2, gpus_per_node=2)]


@pytest.fixture(scope="module")
def runs():
    return launch(subgroup_trains_worker, 4, (SPECS,), timeout_s=150)[0]


def check_matches_single_process(run: dict, experts_per_rank: int) -> None:
    assert run["is_subgroup"] and run["experts_here"] == [experts_per_rank] * 2  # layer 1 and the MTP layer
    assert run["ep_ranks"] == [0, 1] and run["replica_ranks"] == [0, 2]  # rank 0's groups, from the mesh
    assert len(run["losses"]) == 5
    for ep, single in zip(run["losses"], run["single_losses"], strict=True):
        assert abs(ep - single) <= 1e-5 * abs(single)
    # the clip bit (norms above max_norm): the norm counts each expert once, not once per replica
    assert min(run["single_norms"]) > 0.5
    for ep, single in zip(run["norms"], run["single_norms"], strict=True):
        assert abs(ep - single) <= 1e-4 * single
    # the aux-free bias update saw the loads of all four ranks: same biases, and they moved
    assert run["bias_max_abs"] > 0 and run["bias_max_abs_diff"] <= 1e-6
    assert run["replicas_equal"]
    assert run["parameters"] == run["single_parameters"]
    assert run["logits_max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("which", [0, 1], ids=["dp4xep2-gpn1", "dp4xep2-gpn2"])
def test_ep_over_part_of_the_dp_ranks_trains_like_one_process(runs, which):
    check_matches_single_process(runs[which], experts_per_rank=4)


@pytest.mark.skipif(not os.environ.get("DSV3_TEST_EP8"), reason="8 processes: set DSV3_TEST_EP8=1")
def test_dp8_ep4_trains_like_one_process():
    (run,) = launch(subgroup_trains_worker, 8, ([SubgroupSpec(ep=4, gpus_per_node=2)],), timeout_s=240)[0]
    check_matches_single_process(run, experts_per_rank=2)


def test_groups_are_consecutive_blocks_and_strided_replicas():
    layout = Layout(dp=8, ep=4, gpus_per_node=2)
    assert group_ranks(layout, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(layout, "ep_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(layout, "gpu") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the intra-node hop: one node
    assert group_ranks(layout, "node") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # the inter-node hop: one rail


def test_layout_accepts_ep_dividing_dp_and_refuses_the_rest():
    assert Layout(dp=8, ep=4, gpus_per_node=2).check(8).ep == 4
    with pytest.raises(DSV3Error, match="--ep 3 must divide the number of data-parallel processes \\(8\\)"):
        Layout(dp=8, ep=3, gpus_per_node=1).check(8)
    with pytest.raises(DSV3Error, match="--ep 16 must divide"):
        Layout(dp=8, ep=16, gpus_per_node=2).check(8)
    with pytest.raises(DSV3Error, match="--gpus-per-node 4 must divide --ep \\(2\\)"):
        Layout(dp=8, ep=2, gpus_per_node=4).check(8)
