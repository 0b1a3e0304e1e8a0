"""Traffic of the two-hop all-to-all derived from the routing decisions alone (no communication), to check
the bytes the exchange actually sends and to compare with flat (non-deduplicated) dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3.parallel.ep_groups import NodeLayout


@dataclass(frozen=True)
class CopyCounts:
    """Per-token copies for one source rank's tokens (tensors [N])."""

    nodes: torch.Tensor  # destination nodes, own node included (<= topk_group when node-limited)
    inter: torch.Tensor  # inter-node copies with dedup: destination nodes other than the source's
    naive_inter: torch.Tensor  # inter-node copies without dedup: routed choices on other nodes
    intra: torch.Tensor  # intra-node forwards: per destination node, expert ranks other than the forwarder


def copy_counts(slots: torch.Tensor, layout: NodeLayout, rank: int, slots_per_rank: int) -> CopyCounts:
    """slots: long [N, K] physical expert slots chosen by ``rank``'s tokens."""
    n = slots.shape[0]
    dst_rank = slots // slots_per_rank
    dst_node = dst_rank // layout.gpus_per_node
    my_node, my_local = layout.node_of(rank), layout.local_of(rank)
    node_hit = torch.zeros(n, layout.nodes, dtype=torch.bool).scatter_(1, dst_node, True)
    rank_hit = torch.zeros(n, layout.world, dtype=torch.bool).scatter_(1, dst_rank, True)
    per_node = rank_hit.view(n, layout.nodes, layout.gpus_per_node)
    forwarder_hit = per_node[:, :, my_local]  # the forwarder holds experts itself: no intra copy for it
    return CopyCounts(
        nodes=node_hit.sum(1),
        inter=node_hit.sum(1) - node_hit[:, my_node].long(),
        naive_inter=(dst_node != my_node).sum(1),
        intra=(per_node.sum(2) - forwarder_hit.long()).sum(1),
    )


def analytic_bytes(
    counts: CopyCounts, top_k: int, dispatch_row: int, combine_intra_row: int, combine_inter_row: int
) -> dict[tuple[str, str, str], int]:
    """Bytes by (phase, level, kind) that the exchange must send for these tokens, forward and backward.

    Forward: dispatch rows carry the activation and the K fp32 gates, the handshake the K int32 slots;
    combine rows carry the partial sums. Backward mirrors it: the combine's backward broadcasts the
    output gradient (dispatch format), the dispatch's backward reduces the input and gate gradients.
    """
    inter, intra = int(counts.inter.sum()), int(counts.intra.sum())
    gate = slots = 4 * top_k
    out: dict[tuple[str, str, str], int] = {}
    for level, copies, combine_row in (
        ("inter", inter, combine_inter_row),
        ("intra", intra, combine_intra_row),
    ):
        out[("forward", level, "slots")] = copies * slots
        for phase in ("forward", "backward"):
            out[(phase, level, "dispatch")] = copies * dispatch_row
            out[(phase, level, "gate")] = copies * gate
            out[(phase, level, "combine")] = copies * combine_row
    return out
