"""Single-process pieces of expert parallelism: wire formats, placements, traffic arithmetic, EPLB,
and the dual micro-batch interleaver."""

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.parallel import eplb
from dsv3.parallel.ep_groups import NodeLayout
from dsv3.parallel.ep_traffic import analytic_bytes, copy_counts
from dsv3.parallel.overlap import run_interleaved
from dsv3.parallel.placement import Placement
from dsv3.parallel.wire import WireFormat


@pytest.mark.parametrize(
    ("name", "row_bytes", "tol"),
    [
        ("fp32", 1024, 0.0),
        ("bf16", 512, 2**-8),
        ("fp8", 264, 2**-4),
        ("logfmt8", 264, 0.1),
        ("logfmt10", 328, 0.03),
    ],
)
def test_wire_format_sizes_and_error(name, row_bytes, tol):
    x = torch.randn(5, 256) * 0.1
    fmt = WireFormat(name)
    data = fmt.encode(x)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (5, row_bytes) == (5, fmt.row_bytes(256))
    back = fmt.decode(data, 256, torch.float32)
    rel = ((back - x).abs() / x.abs().clamp(min=1e-3)).median()
    assert rel <= tol
    # rows are independent, so a row gathered from the buffer decodes to the same values (forwarding)
    assert torch.equal(fmt.decode(data[[3, 1]], 256, torch.float32), back[[3, 1]])
    assert fmt.encode(x[:0]).shape == (0, row_bytes)


def test_fp8_wire_scales_are_powers_of_two():
    data = WireFormat("fp8").encode(torch.randn(2, 128))
    scale = data[:, 128:].contiguous().view(torch.float32)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def test_placement_replicas_and_choice():
    p = Placement(torch.tensor([0, 1, 2, 0, 3, 0]), world=2)  # expert 0 has 3 replicas
    assert p.slots_per_rank == 3 and p.replica_counts.tolist() == [3, 1, 1, 1]
    assert p.replica_table[0].tolist() == [0, 3, 5]
    slots = p.choose_slots(torch.zeros(6, 1, dtype=torch.long))
    assert slots.flatten().tolist() == [0, 3, 5, 0, 3, 5]  # round robin over replicas
    assert bool(
        (p.phy2log[p.choose_slots(torch.tensor([[1, 3], [2, 0]]))] == torch.tensor([[1, 3], [2, 0]])).all()
    )
    with pytest.raises(DSV3Error):
        Placement(torch.tensor([0, 1, 2]), world=2)


def test_node_alignment():
    assert Placement.contiguous(16, 4).is_node_aligned(n_group=2, gpus_per_node=2)
    assert not Placement.contiguous(16, 4).is_node_aligned(n_group=1, gpus_per_node=2)
    assert not Placement(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), 4).is_node_aligned(2, 2)


def test_copy_counts_by_hand():
    # 2 nodes x 2 ranks, 2 slots per rank: slots 0-3 on node 0 (ranks 0, 1), 4-7 on node 1 (ranks 2, 3)
    layout = NodeLayout(4, 2)
    slots = torch.tensor(
        [
            [0, 1, 4, 6],  # node 0: rank 0 only; node 1: ranks 2 and 3
            [2, 3, 5, 4],
        ]
    )  # node 0: rank 1; node 1: rank 2
    c = copy_counts(slots, layout, rank=0, slots_per_rank=2)
    assert c.nodes.tolist() == [2, 2]
    assert c.inter.tolist() == [1, 1]  # one copy to node 1 each, however many experts there
    assert c.naive_inter.tolist() == [2, 2]
    # token 0: forwarder on node 1 is rank 2 (local 0), so only rank 3 needs a forward; rank 0 is self
    # token 1: rank 1 gets a forward from rank 0; on node 1 rank 2 is the forwarder itself
    assert c.intra.tolist() == [1, 1]
    b = analytic_bytes(c, top_k=4, dispatch_row=100, combine_intra_row=200, combine_inter_row=50)
    assert b[("forward", "inter", "dispatch")] == 200 and b[("forward", "inter", "combine")] == 100
    assert b[("forward", "intra", "combine")] == 400 and b[("forward", "inter", "slots")] == 2 * 16


def test_balanced_packing_equal_counts_and_spread():
    where = eplb.balanced_packing([9, 8, 1, 1, 1, 1], bins=2)
    assert sorted(where.count(b) for b in range(2)) == [3, 3]
    assert where[0] != where[1]  # the two heavy items go to different bins


def test_replicate_gives_hot_experts_more_slots():
    assert eplb.replicate([8.0, 1.0, 1.0], 6) == [4, 1, 1]


def test_policies_balance_skewed_loads():
    load = eplb.skewed_load(64, alpha=1.0, seed=0)
    before = eplb.imbalance(torch.arange(64), load, 16)
    glob = eplb.global_policy(load, 80, 16)
    hier = eplb.hierarchical_policy(load, 80, num_groups=8, num_nodes=4, num_gpus=16)
    for phy in (glob, hier):
        assert phy.numel() == 80 and set(phy.tolist()) == set(range(64))  # every expert somewhere
        for gpu in phy.view(16, 5).tolist():
            assert len(set(gpu)) == len(gpu)  # no expert twice on one GPU
    assert eplb.imbalance(glob, load, 16) < 1.1 < before
    assert eplb.imbalance(hier, load, 16) < before / 2
    # hierarchical keeps each group on one node, so node-limited routing still holds
    assert Placement(hier, 16).is_node_aligned(n_group=8, gpus_per_node=4)


def test_rebalance_trades_moves_for_balance():
    old = eplb.global_policy(eplb.skewed_load(32, seed=0), 40, 8)
    new_load = eplb.skewed_load(32, seed=1)
    start = eplb.imbalance(old, new_load, 8)
    assert eplb.rebalance(old, new_load, 8, max_moves=0).moves == 0
    results = [eplb.rebalance(old, new_load, 8, max_moves=b) for b in (2, 8, 64)]
    for r in results:
        assert r.moves == eplb.moved_experts(old, r.phy2log, 8)
        assert set(r.phy2log.tolist()) == set(range(32))
        assert r.imbalance <= start
    assert [r.moves <= b for r, b in zip(results, (2, 8, 64), strict=True)] == [True] * 3
    assert results[-1].imbalance < start * 0.8
    full = eplb.global_policy(new_load, 40, 8)  # re-planning from scratch moves far more experts
    assert eplb.moved_experts(old, full, 8) > results[1].moves


def test_load_average():
    avg = eplb.LoadAverage(2, decay=0.5)
    avg.update(torch.tensor([4.0, 0.0]))
    assert avg.update(torch.tensor([0.0, 4.0])).tolist() == [2.0, 2.0]


def test_interleaver_alternates_between_yields():
    log = []

    def steps(name, n):
        for i in range(n):
            log.append(f"{name}{i}")
            yield
        return name

    assert run_interleaved([steps("a", 2), steps("b", 3)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "b2"]
