"""Which logical expert each physical expert slot holds, and which replica a token goes to.

Without EPLB every rank holds ``E / W`` consecutive experts, so node ``n`` holds one contiguous block of
``E / nodes`` experts: with ``n_group`` a multiple of the node count each router group lives on one node,
and group-limited routing is node-limited routing. EPLB placements add redundant slots (replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from dsv3.errors import DSV3Error


@dataclass(frozen=True)
class Placement:
    """``phy2log[p]`` = logical expert held by physical slot ``p``; rank ``r`` owns slots
    ``[r * S, (r + 1) * S)`` with ``S = slots_per_rank``."""

    phy2log: torch.Tensor  # long [W * S]
    world: int

    def __post_init__(self) -> None:
        if self.phy2log.dim() != 1 or self.phy2log.numel() % self.world:
            raise DSV3Error(
                f"{self.phy2log.numel()} physical expert slots cannot be spread evenly over "
                f"{self.world} EP ranks"
            )

    @classmethod
    def contiguous(cls, n_experts: int, world: int) -> Placement:
        if n_experts % world:
            raise DSV3Error(f"{n_experts} routed experts cannot be split evenly over {world} EP ranks")
        return cls(torch.arange(n_experts), world)

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.numel() // self.world

    @property
    def n_experts(self) -> int:
        return int(self.phy2log.max()) + 1

    def rank_experts(self, rank: int) -> torch.Tensor:
        """Logical experts held by ``rank``'s slots, in slot order: long [S]."""
        s = self.slots_per_rank
        return self.phy2log[rank * s : (rank + 1) * s]

    @cached_property
    def replica_counts(self) -> torch.Tensor:
        """logcnt: long [E], replicas of each logical expert."""
        return torch.bincount(self.phy2log, minlength=self.n_experts)

    @cached_property
    def replica_table(self) -> torch.Tensor:
        """log2phy: long [E, max replicas], row e lists e's physical slots (padded with -1)."""
        counts, n_experts = self.replica_counts, self.n_experts
        if bool((counts == 0).any()):
            missing = (counts == 0).nonzero().flatten().tolist()
            raise DSV3Error(f"placement holds no replica of experts {missing[:8]}")
        order = torch.argsort(self.phy2log, stable=True)
        table = torch.full((n_experts, int(counts.max())), -1, dtype=torch.long)
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(order.numel()) - starts[self.phy2log[order]]
        table[self.phy2log[order], within] = order
        return table

    def choose_slots(self, idx: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """Physical slot for each routed choice: idx [N, K] logical -> [N, K] physical.

        A token picks replica ``(token + salt) mod replicas``: deterministic and spreading a hot expert's
        tokens evenly over its replicas; ``salt`` (the rank) decorrelates ranks.
        """
        table, counts = self.replica_table, self.replica_counts
        token = torch.arange(idx.shape[0]).unsqueeze(1) + salt
        return table[idx, token % counts[idx]]

    def nodes_of_groups(self, n_group: int, gpus_per_node: int) -> list[set[int]]:
        """For each router group, the set of nodes holding some replica of its experts."""
        node = torch.arange(self.phy2log.numel()) // (self.slots_per_rank * gpus_per_node)
        size = self.n_experts // n_group
        return [set(node[self.phy2log // size == g].tolist()) for g in range(n_group)]

    def is_node_aligned(self, n_group: int, gpus_per_node: int) -> bool:
        """True when every router group lives on one node: then group-limited = node-limited routing."""
        if self.n_experts % n_group:
            return False
        return all(len(nodes) == 1 for nodes in self.nodes_of_groups(n_group, gpus_per_node))
