"""The simulator against closed forms and the paper's claims (MPFT vs MRFT, ECMP, planes, EP)."""

from dataclasses import replace

import numpy as np
import pytest

from dsv3.errors import DSV3Error
from dsv3.network.catalog import TopologySpec
from dsv3.network.fabric import LinkSpeeds
from dsv3.network.moe import EPSpec, route_tokens
from dsv3.network.simulate import SimConfig, run_simulation

NIC = 50e9  # 400 Gb/s in bytes/s
MiB = 2**20


def sim(kind="mpft", gpus=128, **kw):
    return run_simulation(SimConfig(topology=TopologySpec(kind=kind, endpoints=gpus), **kw))


@pytest.mark.parametrize("gpus", [32, 128, 512])
def test_mpft_alltoall_matches_mrft_within_two_percent(gpus):
    mpft, mrft = sim("mpft", gpus), sim("mrft", gpus)
    assert mpft["algbw_GBps"] == pytest.approx(mrft["algbw_GBps"], rel=0.02)
    # both are NIC-bound: inter-node bytes leave each GPU's NIC at line rate
    inter = (gpus - 8) / gpus
    bound = 256 * MiB / (inter * 256 * MiB / NIC) / 1e9
    assert mpft["algbw_GBps"] == pytest.approx(bound, rel=0.01)
    assert mpft["link_utilization"]["nic_up"]["mean"] > 0.99


def test_alltoall_busbw_uses_nccl_tests_factor():
    r = sim("mrft", 64)
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 63 / 64)


def _max_switch_link_count(gpus: int, seed: int) -> int:
    """Re-derive from the simulator's own routes how many equal flows share the busiest spine link."""
    from dsv3.network.catalog import build_topology
    from dsv3.network.fabric import Fabric
    from dsv3.network.flowset import build_flows
    from dsv3.network.segments import SegmentBuilder
    from dsv3.network.simulate import make_workload

    cfg = SimConfig(topology=TopologySpec("ft2", endpoints=gpus), traffic="permutation", routing="ecmp", seed=seed)
    fabric = Fabric(build_topology(cfg.topology))
    builder = SegmentBuilder(fabric)
    for chunk in make_workload(cfg, gpus, 8).chunks():
        builder.add(*chunk)
    flows = build_flows(fabric, builder.build(), "ecmp", seed=seed).flows
    counts = np.bincount(flows.direct.ravel(), minlength=flows.n_links)[: fabric.n_switch_links]
    return int(counts.max())


def test_ecmp_permutation_time_is_set_by_the_most_collided_link():
    size = 64 * MiB
    r = sim("ft2", 64, traffic="permutation", routing="ecmp", message_bytes=size, seed=3, rtol=0)
    worst = _max_switch_link_count(64, seed=3)
    assert r["step"]["fluid_us"] == pytest.approx(worst * size / NIC * 1e6, rel=1e-9)


def test_ecmp_matches_balls_into_bins_and_static_adaptive_do_not_collide():
    """Half-turn permutation on a 64-endpoint FT2: 32 flows per direction hashed onto 32 spines."""
    size = 256 * MiB
    adaptive = sim("ft2", 64, traffic="permutation", routing="adaptive", message_bytes=size)
    static = sim("ft2", 64, traffic="permutation", routing="static", message_bytes=size)
    line = size / (size / NIC + 3.7e-6) / 1e9
    assert adaptive["algbw_GBps"] == pytest.approx(line, rel=1e-6)
    assert static["algbw_GBps"] == pytest.approx(line, rel=1e-6)  # destination-mod-k: conflict free
    ecmp = [sim("ft2", 64, traffic="permutation", routing="ecmp", message_bytes=size, seed=s)["algbw_GBps"]
            for s in range(64)]
    measured = np.mean(ecmp) / adaptive["algbw_GBps"]
    # balls into bins (docs/references.md#ecmp-collisions): two independent directions of 32 balls in 32 bins
    rng = np.random.default_rng(0)
    loads = np.stack([np.apply_along_axis(np.bincount, 1, rng.integers(0, 32, (4000, 32)), minlength=32).max(1)
                      for _ in range(2)])
    expected = (1 / loads.max(0)).mean()
    assert 0.2 < measured < 0.4
    assert measured == pytest.approx(expected, abs=0.03)


def test_more_queue_pairs_give_ecmp_more_entropy():
    base = dict(traffic="permutation", routing="ecmp", message_bytes=256 * MiB)
    one = np.mean([sim("ft2", 64, qps=1, seed=s, **base)["algbw_GBps"] for s in range(6)])
    many = np.mean([sim("ft2", 64, qps=8, seed=s, **base)["algbw_GBps"] for s in range(6)])
    assert many > 1.5 * one


@pytest.mark.parametrize("kind", ["mpft", "mrft"])
def test_plane_failure_costs_one_eighth_and_forwards_over_nvlink(kind):
    healthy, failed = sim(kind, 128), sim(kind, 128, fail_plane=2)
    assert failed["algbw_GBps"] == pytest.approx(healthy["algbw_GBps"] * 7 / 8, rel=0.01)
    assert failed["bytes"]["forwarded_over_nvlink"] > healthy["bytes"]["forwarded_over_nvlink"]


def _fail_first_leaf_and_route(kind: str, gpus: int):
    from dsv3.network.catalog import build_topology
    from dsv3.network.fabric import Fabric
    from dsv3.network.segments import SegmentBuilder
    from dsv3.network.traffic import alltoall

    fabric = Fabric(build_topology(TopologySpec(kind, endpoints=gpus)))
    fabric.fail_switches([fabric.switch_names.index(fabric.topo.endpoint_switch[0])])
    builder = SegmentBuilder(fabric)
    for chunk in alltoall(gpus, 1.0).chunks():
        builder.add(*chunk)
    return builder.build()


def test_leaf_failure_disconnects_ft2_nodes_but_not_mpft_nodes():
    with pytest.raises(DSV3Error, match="cannot reach"):  # FT2 puts all 8 NICs of a node on one leaf
        _fail_first_leaf_and_route("ft2", 64)
    segs = _fail_first_leaf_and_route("mpft", 512)  # MPFT: the node still has 7 planes
    assert segs.stats["relayed_transfers"] > 0
    r = sim("mpft", 512, fail_switches=4, seed=1)
    assert r["algbw_GBps"] > 0.8 * sim("mpft", 512)["algbw_GBps"]


def test_price_of_cross_plane_forwarding():
    small = 4096
    mpft, mrft = sim("mpft", 128, message_bytes=small), sim("mrft", 128, message_bytes=small)
    # MPFT: an NVLink hop (3.33 us) then the same-leaf IB path (2.8 us, Table 5); MRFT crosses a spine (3.7 us)
    assert mpft["step"]["latency_us"] == pytest.approx(3.33 + 2.8)
    assert mrft["step"]["latency_us"] == pytest.approx(3.7)
    # 7 of every 8 inter-node bytes take an NVLink detour in MPFT; none in MRFT without PXN
    big_mpft = sim("mpft", 128)
    assert big_mpft["bytes"]["forwarded_over_nvlink"] == pytest.approx(7 / 8 * big_mpft["bytes"]["internode"])
    assert sim("mrft", 128)["bytes"]["forwarded_over_nvlink"] == 0
    # with PXN, MRFT forwards exactly like MPFT (the paper's explanation of their parity)
    assert sim("mrft", 128, pxn=True, message_bytes=small)["step"]["latency_us"] == pytest.approx(
        mpft["step"]["latency_us"])
    # a weak scale-up link makes the detour the bottleneck in MPFT only
    weak = LinkSpeeds(nvlink_GBps=30)
    assert sim("mpft", 128, speeds=weak)["algbw_GBps"] < 0.8 * sim("mrft", 128, speeds=weak)["algbw_GBps"]


def test_ring_allgather_follows_the_alpha_beta_formula():
    size = 512 * MiB
    r = sim("mpft", 64, traffic="allgather", group="dp", message_bytes=size)
    n = 8  # one ring per local index across the 8 nodes, all on one leaf per plane
    expected = (n - 1) * (2.8e-6 + size / n / NIC)
    assert r["time_us"] == pytest.approx(expected * 1e6, rel=1e-6)
    assert r["busbw_GBps"] == pytest.approx(size / expected * (n - 1) / n / 1e9, rel=1e-6)


def test_allreduce_takes_twice_the_steps():
    ag = sim("mpft", 64, traffic="allgather", message_bytes=64 * MiB)
    ar = sim("mpft", 64, traffic="allreduce", message_bytes=64 * MiB)
    assert ar["time_us"] == pytest.approx(2 * ag["time_us"])


def test_incast_shares_the_receivers_nic():
    r = sim("mrft", 128, traffic="incast", incast_sources=10, message_bytes=64 * MiB)
    assert r["step"]["fluid_us"] == pytest.approx(10 * 64 * MiB / NIC * 1e6, rel=1e-6)


def test_ecmp_hurts_fragmented_dp_rings_on_a_multi_leaf_plane():
    kw = dict(traffic="allgather", group="dp", placement="random", message_bytes=256 * MiB)
    adaptive, ecmp = sim("mpft", 1024, routing="adaptive", **kw), sim("mpft", 1024, routing="ecmp", **kw)
    assert ecmp["busbw_GBps"] < 0.6 * adaptive["busbw_GBps"]
    assert adaptive["busbw_GBps"] > 40


def test_router_is_node_limited():
    rng = np.random.default_rng(0)
    scores = 1 / (1 + np.exp(-rng.standard_normal((2000, 64))))
    experts = route_tokens(scores, n_groups=8, topk=8, topk_groups=4)
    groups = experts // 8
    assert max(len(set(row)) for row in groups) <= 4
    assert all(len(set(row)) == 8 for row in experts)


def test_node_limited_dedup_cuts_internode_ep_bytes():
    base = EPSpec(tokens_per_gpu=512)
    limited = sim("mpft", 128, traffic="ep-dispatch", ep=base)["traffic"]
    free = sim("mpft", 128, traffic="ep-dispatch", ep=replace(base, node_limit=0))["traffic"]
    nodup = sim("mpft", 128, traffic="ep-dispatch", ep=replace(base, dedup=False))["traffic"]
    assert limited["ib_copies_per_token"] <= 4
    assert limited["ib_copies_per_token"] < 0.75 * free["ib_copies_per_token"]
    assert nodup["ib_copies_per_token"] > limited["ib_copies_per_token"]


def test_ep_dispatch_runs_near_nic_line_rate_with_adaptive_routing():
    r = sim("mpft", 64, traffic="ep-dispatch", ep=EPSpec(tokens_per_gpu=1024))
    assert r["nic"]["tx_GBps_mean"] > 0.9 * 50
    # the token crosses IB to the same local index (same plane), then NVLink: never a cross-plane relay
    assert r["bytes"]["forwarded_over_nvlink"] == 0 and r["bytes"]["nvlink"] > 0
    combine = sim("mpft", 64, traffic="ep-combine", ep=EPSpec(tokens_per_gpu=1024))
    assert combine["bytes"]["network"] == pytest.approx(2 * 7168 / (7168 + 224) * r["bytes"]["network"])


@pytest.mark.parametrize("kind,extra", [("sf", {}), ("df", {})])
def test_low_diameter_topologies_simulate(kind, extra):
    r = run_simulation(SimConfig(topology=TopologySpec(kind, q=5, p=2, a=4, h=2, endpoints=64)))
    assert 0 < r["link_utilization"]["switch"]["max"] <= 1 + 1e-9
    assert r["algbw_GBps"] > 0


def test_bad_simulation_input_is_a_clear_error():
    with pytest.raises(DSV3Error, match="routing"):
        sim(routing="random")
    with pytest.raises(DSV3Error, match="fail-plane"):
        sim("ft2", 64, fail_plane=0)
    with pytest.raises(DSV3Error, match="experts"):
        sim("mpft", 2048 // 8 * 8 // 2 * 2, traffic="ep-dispatch", ep=EPSpec(experts=100))
