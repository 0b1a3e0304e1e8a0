"""Ranks grouped into nodes, and the two process groups each rank talks over in the two-hop all-to-all.

EP rank ``r`` sits on node ``r // gpus_per_node`` with local index ``r % gpus_per_node``. The inter-node
hop runs over the ranks that share a local index (one per node: the "same in-node index" GPU of V3
§3.2.2, one NIC each), the intra-node hop over the ranks of one node (NVLink on a real machine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dsv3.errors import DSV3Error


@dataclass(frozen=True)
class NodeLayout:
    """Where every EP rank sits; pure arithmetic, no process groups (tests and planners use it)."""

    world: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.world < 1 or self.world % self.gpus_per_node:
            raise DSV3Error(
                f"an EP world of {self.world} ranks cannot be split into nodes of {self.gpus_per_node} GPUs"
            )

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    def node_ranks(self, node: int) -> list[int]:
        """EP ranks of one node, in local-index order (the intra-node group)."""
        return [self.rank_of(node, i) for i in range(self.gpus_per_node)]

    def rail_ranks(self, local: int) -> list[int]:
        """EP ranks with one local index, in node order (the inter-node group: one GPU per node)."""
        return [self.rank_of(n, local) for n in range(self.nodes)]


@dataclass
class EPGroups:
    """This rank's place in the EP world plus its three groups: all EP ranks, its node, its rail."""

    layout: NodeLayout
    rank: int  # EP rank (index into the EP group, not necessarily the global rank)
    ep: dist.ProcessGroup | None  # None: the default (world) group
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup

    @property
    def node(self) -> int:
        return self.layout.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.layout.local_of(self.rank)


def make_ep_groups(gpus_per_node: int, group: dist.ProcessGroup | None = None) -> EPGroups:
    """Create the intra-node and inter-node sub-groups of ``group`` (default: the world).

    Every rank of the world must call this, in the same order, since ``new_group`` is collective.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise DSV3Error("expert parallelism needs an initialized torch.distributed process group")
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mine = ep_groups_of(members, gpus_per_node, group)
    if mine is None:
        raise DSV3Error(f"rank {dist.get_rank()} is not a member of the EP group")
    return mine


def ep_groups_of(members: list[int], gpus_per_node: int, ep: dist.ProcessGroup | None) -> EPGroups | None:
    """The node and rail sub-groups of the EP group ``ep`` over global ranks ``members``, created on every
    rank of the world (``new_group`` is collective), in one order; this rank's `EPGroups`, or None when it
    is not a member."""
    layout = NodeLayout(len(members), gpus_per_node)
    me = dist.get_rank()
    intra = inter = None
    for node in range(layout.nodes):
        ranks = [members[r] for r in layout.node_ranks(node)]
        g = dist.new_group(ranks)
        intra = g if me in ranks else intra
    for local in range(gpus_per_node):
        ranks = [members[r] for r in layout.rail_ranks(local)]
        g = dist.new_group(ranks)
        inter = g if me in ranks else inter
    if me not in members:
        return None
    return EPGroups(layout, members.index(me), ep, intra, inter)
