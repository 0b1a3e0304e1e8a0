"""Expert-parallel load balancing (the policies of DeepSeek's EPLB, our own code) and incremental
rebalancing with few expert moves.

Given each logical expert's load (a moving average of observed token counts), choose ``num_slots``
physical slots, ``num_slots / num_gpus`` per GPU, each holding one logical expert; hot experts get
several slots (replicas) and a token goes to one replica, so a replica serves ``load / replicas``.

- Hierarchical policy (node count divides the group count; prefill in DeepSeek's deployment): pack the
  router groups onto nodes so node loads are even (which keeps node-limited routing intact), replicate
  hot experts within each node, then pack the replicas onto the node's GPUs.
- Global policy (decode with large EP): replicate over all experts and pack onto all GPUs.
- Rebalance: from the current placement and new loads, improve the max GPU load by swaps and by
  re-targeting redundant slots, counting expert moves, so engines can trade movement for balance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from dsv3.errors import DSV3Error


class LoadAverage:
    """Exponential moving average of per-expert loads: the load estimate EPLB plans from."""

    def __init__(self, n_experts: int, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise DSV3Error(f"load decay must be in [0, 1), got {decay}")
        self.decay, self.value, self.steps = decay, torch.zeros(n_experts, dtype=torch.float64), 0

    def update(self, load: torch.Tensor) -> torch.Tensor:
        load = load.to(torch.float64)
        self.value = load.clone() if self.steps == 0 else self.decay * self.value + (1 - self.decay) * load
        self.steps += 1
        return self.value


def balanced_packing(weights: list[float], bins: int, avoid: list[int] | None = None) -> list[int]:
    """Assign items to ``bins`` bins of equal count (len / bins), heaviest first, each to the lightest bin
    with room; ``avoid[i]`` (an item key) steers replicas of one expert to different bins when possible.
    Returns the bin of each item."""
    n = len(weights)
    if n % bins:
        raise DSV3Error(f"{n} items cannot be packed evenly into {bins} bins")
    capacity, load, count = n // bins, [0.0] * bins, [0] * bins
    keys: list[set] = [set() for _ in range(bins)]
    where = [0] * n
    for i in sorted(range(n), key=lambda i: -weights[i]):
        room = [b for b in range(bins) if count[b] < capacity]
        fresh = [b for b in room if avoid is None or avoid[i] not in keys[b]]
        b = min(fresh or room, key=lambda b: (load[b], b))
        where[i], load[b], count[b] = b, load[b] + weights[i], count[b] + 1
        if avoid is not None:
            keys[b].add(avoid[i])
    return where


def replicate(load: list[float], num_slots: int, max_replicas: int | None = None) -> list[int]:
    """Replica counts: one each, then each extra slot to the expert with the highest load per replica.
    ``max_replicas`` (the GPU count) keeps an expert from two slots on one GPU, which would gain nothing."""
    if num_slots < len(load):
        raise DSV3Error(f"{num_slots} slots cannot hold {len(load)} experts")
    cap = max_replicas if max_replicas and max_replicas * len(load) >= num_slots else num_slots
    counts = [1] * len(load)
    for _ in range(num_slots - len(load)):
        e = max((e for e in range(len(load)) if counts[e] < cap), key=lambda e: (load[e] / counts[e], -e))
        counts[e] += 1
    return counts


def _pack_replicas(experts: list[int], load: list[float], counts: list[int], gpus: int) -> list[list[int]]:
    """Replicas of ``experts`` (with ``counts``) packed onto ``gpus`` GPUs: the slot lists per GPU."""
    items = [e for e in experts for _ in range(counts[e])]
    where = balanced_packing([load[e] / counts[e] for e in items], gpus, avoid=items)
    per_gpu: list[list[int]] = [[] for _ in range(gpus)]
    for e, g in zip(items, where, strict=True):
        per_gpu[g].append(e)
    return [sorted(s) for s in per_gpu]


def global_policy(load: torch.Tensor, num_slots: int, num_gpus: int) -> torch.Tensor:
    """phy2log long [num_slots]: replicate over all experts, pack replicas onto all GPUs."""
    _check_sizes(load.numel(), num_slots, num_gpus)
    w = load.double().tolist()
    counts = replicate(w, num_slots, max_replicas=num_gpus)
    return torch.tensor(
        [e for slots in _pack_replicas(list(range(len(w))), w, counts, num_gpus) for e in slots]
    )


def hierarchical_policy(
    load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """phy2log long [num_slots]: groups packed onto nodes, replication within nodes, replicas onto GPUs.
    Each group's replicas stay on one node, so group-limited routing remains node-limited."""
    E = load.numel()
    _check_sizes(E, num_slots, num_gpus)
    if E % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_slots % num_nodes:
        raise DSV3Error(
            f"hierarchical EPLB needs groups ({num_groups}) divisible by nodes ({num_nodes}), and "
            f"experts ({E}), GPUs ({num_gpus}) and slots ({num_slots}) divisible evenly"
        )
    w = load.double().tolist()
    size = E // num_groups
    group_load = [sum(w[g * size : (g + 1) * size]) for g in range(num_groups)]
    node_of_group = balanced_packing(group_load, num_nodes)
    phy2log = []
    for node in range(num_nodes):
        experts = [
            e for g in range(num_groups) if node_of_group[g] == node for e in range(g * size, (g + 1) * size)
        ]
        sub = replicate([w[e] for e in experts], num_slots // num_nodes, max_replicas=num_gpus // num_nodes)
        counts = dict(zip(experts, sub, strict=True))
        per_gpu = _pack_replicas(experts, w, [counts.get(e, 0) for e in range(E)], num_gpus // num_nodes)
        phy2log += [e for slots in per_gpu for e in slots]
    return torch.tensor(phy2log)


def _check_sizes(n_experts: int, num_slots: int, num_gpus: int) -> None:
    if num_slots < n_experts or num_slots % num_gpus:
        raise DSV3Error(
            f"{num_slots} slots must be at least the {n_experts} experts and divide evenly over "
            f"{num_gpus} GPUs"
        )


def gpu_loads(phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Expected load per GPU [num_gpus]: each replica serves its expert's load / replica count."""
    counts = torch.bincount(phy2log, minlength=load.numel()).double()
    per_slot = load.double()[phy2log] / counts[phy2log]
    return per_slot.view(num_gpus, -1).sum(1)


def imbalance(phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> float:
    """max / mean GPU load (1.0 is perfect balance)."""
    g = gpu_loads(phy2log, load, num_gpus)
    return float(g.max() / g.mean()) if float(g.mean()) > 0 else 1.0


def moved_experts(old: torch.Tensor, new: torch.Tensor, num_gpus: int) -> int:
    """Expert weights that must be copied to go from ``old`` to ``new``: per GPU, the slots holding an
    expert the GPU did not hold before (slot order within a GPU is free)."""
    moves = 0
    for a, b in zip(old.view(num_gpus, -1).tolist(), new.view(num_gpus, -1).tolist(), strict=True):
        moves += sum((Counter(b) - Counter(a)).values())
    return moves


@dataclass(frozen=True)
class Rebalance:
    phy2log: torch.Tensor
    moves: int
    imbalance: float


def rebalance(
    current: torch.Tensor, load: torch.Tensor, num_gpus: int, max_moves: int, gpus_per_node: int | None = None
) -> Rebalance:
    """Greedy incremental rebalancing under a budget of expert moves.

    Each round takes the change that lowers the hottest GPU's load most while staying within the budget:
    swapping a slot of the hottest GPU with a slot elsewhere (up to 2 moves), or re-targeting a redundant
    replica (of an expert that keeps another one) to the expert with the highest load per replica
    (1 move). With ``gpus_per_node``, changes stay within a node, so a node-aligned placement stays so.
    """
    phy = current.clone()
    best = imbalance(phy, load, num_gpus)
    while True:
        candidate = _best_step(current, phy, load, num_gpus, max_moves, gpus_per_node)
        if candidate is None or imbalance(candidate, load, num_gpus) >= best - 1e-12:
            break
        phy, best = candidate, imbalance(candidate, load, num_gpus)
    return Rebalance(phy, moved_experts(current, phy, num_gpus), best)


def _best_step(
    start: torch.Tensor,
    phy: torch.Tensor,
    load: torch.Tensor,
    num_gpus: int,
    max_moves: int,
    gpus_per_node: int | None,
) -> torch.Tensor | None:
    """The swap or re-target with the lowest resulting peak GPU load whose total moves from ``start``
    fit the budget; None if there is none."""
    per_gpu = phy.numel() // num_gpus
    hot = int(gpu_loads(phy, load, num_gpus).argmax())
    counts = torch.bincount(phy, minlength=load.numel())

    def node(slot: int) -> int:
        return (slot // per_gpu) // gpus_per_node if gpus_per_node else 0

    options = []
    for s in range(hot * per_gpu, (hot + 1) * per_gpu):
        for t in range(phy.numel()):
            if t // per_gpu != hot and node(t) == node(s) and phy[s] != phy[t]:
                swapped = phy.clone()
                swapped[s], swapped[t] = phy[t], phy[s]
                options.append(swapped)
    target = int((load.double() / counts.clamp(min=1)).argmax())
    target_node = node(int((phy == target).nonzero()[0]))
    for s in range(phy.numel()):
        e = int(phy[s])
        if counts[e] > 1 and e != target and node(s) == target_node:
            retarget = phy.clone()
            retarget[s] = target
            options.append(retarget)
    peaks = [float(gpu_loads(o, load, num_gpus).max()) for o in options]
    for i in sorted(range(len(options)), key=lambda i: peaks[i]):
        if moved_experts(start, options[i], num_gpus) <= max_moves:
            return options[i]
    return None


def skewed_load(n_experts: int, alpha: float = 1.2, seed: int = 0, tokens: float = 1e5) -> torch.Tensor:
    """A Zipf-like load over shuffled experts: the kind of skew EPLB exists for."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(n_experts, generator=gen).double() + 1
    w = ranks.pow(-alpha)
    return w / w.sum() * tokens
