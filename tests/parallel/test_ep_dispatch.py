"""The EP layer on gloo, 4 processes (2 nodes x 2) and 8 processes (4 nodes x 2), against one process:
outputs and gradients, traffic counted from what was sent against the analytic count, node limits."""

import pytest

from dsv3.testing.ep_scenarios import LayerSpec, layers_worker
from dsv3.testing.launch import launch

TIMEOUT_S = 90

FOUR = {
    "exact": LayerSpec(nodes=2, gpus_per_node=2, topk_groups=1),
    "bf16": LayerSpec(nodes=2, gpus_per_node=2, dispatch="bf16", combine="bf16", dtype="bfloat16", seed=1),
    "fp8_logfmt8": LayerSpec(nodes=2, gpus_per_node=2, dispatch="fp8", combine="logfmt8", seed=2),
    # a strong selection bias sends every token to one node's experts: the other node receives nothing
    "empty_node": LayerSpec(nodes=2, gpus_per_node=2, topk_groups=1, skew=5.0, seed=5),
    # global EPLB placement with 4 redundant slots (hot experts replicated across nodes), reached by moving
    # the weights of a contiguous placement with set_placement
    "replicas": LayerSpec(
        nodes=2,
        gpus_per_node=2,
        seed=3,
        skew=0.5,
        move_to_placement=True,
        phy2log=(0, 1, 2, 3, 4, 0, 5, 6, 7, 8, 1, 9, 10, 11, 12, 2, 13, 14, 15, 3),
    ),
    # the trainer's FP8 recipe on the sharded layer (exact wires): the experts must compute in FP8 there too
    "fp8_experts": LayerSpec(nodes=2, gpus_per_node=2, fp8=True, seed=6),
}
EIGHT = {
    "exact": LayerSpec(nodes=4, gpus_per_node=2, topk_groups=2, tokens=16),
    "bf16_logfmt10": LayerSpec(
        nodes=4,
        gpus_per_node=2,
        topk_groups=2,
        tokens=16,
        dispatch="bf16",
        combine="logfmt10",
        dtype="bfloat16",
        seed=4,
    ),
}


@pytest.fixture(scope="module")
def four():
    return dict(
        zip(FOUR, launch(layers_worker, 4, (list(FOUR.values()),), timeout_s=TIMEOUT_S)[0], strict=True)
    )


@pytest.fixture(scope="module")
def eight():
    return dict(
        zip(EIGHT, launch(layers_worker, 8, (list(EIGHT.values()),), timeout_s=TIMEOUT_S)[0], strict=True)
    )


def assert_close(result, out_tol, grad_tol):
    """Errors relative to the single-process layer (norm of the difference / norm of the reference)."""
    assert result["output_rel_error"] <= out_tol, result["output_rel_error"]
    for name, err in result["grad_rel_error"].items():
        assert err <= grad_tol, (name, err)
    assert result["expert_load_equal"]
    assert result["aux_loss_diff"] <= 1e-6


def assert_traffic(result, spec):
    assert result["traffic_matches_analytic"], (result["traffic_measured"], result["traffic_analytic"])
    measured = result["traffic_measured"]
    # every kind of traffic really flowed, forward and backward, on both hops
    for key in (
        "forward/inter/dispatch",
        "forward/intra/dispatch",
        "forward/inter/combine",
        "backward/inter/dispatch",
        "backward/intra/combine",
    ):
        assert measured[key] > 0, key
    assert result["max_nodes_per_token"] <= spec.topk_groups
    assert result["max_inter_node_copies_per_token"] <= spec.topk_groups
    assert result["node_limit"] == spec.topk_groups


def test_four_processes_fp32_wire_is_exact(four):
    r = four["exact"]
    assert_close(r, 1e-6, 1e-6)
    assert_traffic(r, FOUR["exact"])
    # M = 1: every token stays on one node, so no token crosses nodes more than once
    assert r["max_nodes_per_token"] == 1


def test_four_processes_bf16_equals_up_to_bf16_rounding(four):
    assert_close(four["bf16"], 4e-3, 8e-3)  # bf16 has 8 significant bits: 2^-8 = 3.9e-3
    assert_traffic(four["bf16"], FOUR["bf16"])
    assert four["bf16"]["bytes_per_token_row"] == {
        "dispatch": 256,
        "combine_inter": 256,
        "combine_intra": 256,
    }


def test_four_processes_fp8_dispatch_logfmt8_combine_within_quantization_error(four):
    r = four["fp8_logfmt8"]
    assert 1e-3 < r["output_rel_error"] <= 0.05  # quantized for real, and only by E4M3 / LogFMT-8 error
    assert_close(r, 0.05, 0.06)
    assert_traffic(r, FOUR["fp8_logfmt8"])
    # 128 E4M3 values + one fp32 scale; 128 LogFMT-8 codes + a bf16 (amax, amin) pair; intra-node stays bf16
    assert r["bytes_per_token_row"] == {"dispatch": 132, "combine_inter": 132, "combine_intra": 256}


def test_four_processes_with_idle_ranks(four):
    r = four["empty_node"]
    assert r["assignments_per_rank"].count(0) >= 1  # some rank's experts got no token at all
    assert_close(r, 1e-6, 1e-6)
    assert r["traffic_matches_analytic"]


def test_four_processes_replicated_experts(four):
    r = four["replicas"]
    assert_close(r, 1e-6, 1e-6)
    assert r["traffic_matches_analytic"]
    assert r["node_limit"] is None  # replicas on both nodes: no longer node-aligned
    assert sum(r["assignments_per_rank"]) == 4 * 16 * 4  # every token-expert pair served exactly once


def test_eight_processes_fp32_wire_is_exact_and_node_limited(eight):
    r = eight["exact"]
    assert_close(r, 1e-6, 1e-6)
    assert_traffic(r, EIGHT["exact"])
    assert r["max_inter_node_copies_per_token"] <= 2
    # the same tokens without the node limit reach more nodes; without dedup even more copies
    assert r["without_node_limit"]["max_inter_node_copies_per_token"] > 2
    assert r["mean_inter_node_copies_without_dedup"] > r["mean_inter_node_copies_per_token"]


def test_eight_processes_bf16_dispatch_logfmt10_combine(eight):
    r = eight["bf16_logfmt10"]
    assert_close(r, 1e-2, 2e-2)
    assert_traffic(r, EIGHT["bf16_logfmt10"])
    assert r["bytes_per_token_row"]["combine_inter"] == 128 * 10 // 8 + 4


def test_four_processes_fp8_experts_equal_the_single_process_fp8_layer(four):
    """`--ep` with `--precision fp8`: the sharded experts run the FP8 GEMMs, so outputs and gradients equal
    the single-process FP8 layer's up to fp32 rounding (activation tiles are per row; each expert's few rows
    fit one 128-row Wgrad tile wherever they are computed). Plain experts would be off by FP8's error.
    Only the shared experts' weight gradients differ more: data parallel, each rank's FP8 Wgrad tiles hold
    its own tokens, one process's hold all of them."""
    r = four["fp8_experts"]
    assert r["output_rel_error"] <= 1e-5, r["output_rel_error"]
    errors = r["grad_rel_error"]
    for name in ("x", "gate.weight", "experts.gate_proj", "experts.up_proj", "experts.down_proj"):
        assert errors[name] <= 1e-5, (name, errors[name])
    assert max(errors.values()) <= 0.05
    assert r["expert_load_equal"] and r["traffic_matches_analytic"]
