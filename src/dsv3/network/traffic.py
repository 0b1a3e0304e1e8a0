"""Traffic patterns as GPU-to-GPU transfers, with the NCCL-tests size and bus-bandwidth conventions.

A workload is one phase of concurrent transfers, repeated ``steps`` times (a ring collective's steps
are identical, so one simulated step times the step count is exact in the fluid model). ``size_bytes``
is NCCL-tests' S, so algbw = S / time and busbw = algbw * busbw_factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dsv3.errors import DSV3Error

Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # src GPU, dst GPU, bytes


@dataclass
class Workload:
    name: str
    chunks: Callable[[], Iterator[Chunk]]  # called once; yields transfers in memory-bounded pieces
    size_bytes: float  # NCCL-tests S
    ranks: int  # participants per collective
    steps: int = 1
    busbw_factor: float = 1.0
    info: dict = field(default_factory=dict)


def alltoall(n_gpus: int, size_bytes: float, chunk_gpus: int = 64) -> Workload:
    """Uniform all-to-all: every GPU sends S/n to every GPU (the self chunk stays local)."""
    if n_gpus < 2:
        raise DSV3Error("all-to-all needs at least 2 GPUs")
    per_peer = size_bytes / n_gpus

    def chunks() -> Iterator[Chunk]:
        dst_all = np.arange(n_gpus)
        for lo in range(0, n_gpus, chunk_gpus):
            src = np.arange(lo, min(lo + chunk_gpus, n_gpus))
            s = np.repeat(src, n_gpus)
            d = np.tile(dst_all, len(src))
            yield s, d, np.full(len(s), per_peer)

    return Workload("alltoall", chunks, size_bytes, n_gpus, 1, (n_gpus - 1) / n_gpus)


def permutation(n_gpus: int, size_bytes: float, shift: int | None, order: np.ndarray, gpus_per_node: int) -> Workload:
    """Every GPU sends S to one partner: GPU i -> i + shift (over the node order), default a half turn.

    A half-turn shift sends every flow across the middle of the fabric: N flows over N equal-cost
    paths, the balls-into-bins case where ECMP's hash collisions show most plainly.
    """
    shift = n_gpus // 2 if shift is None else shift
    if not 0 < shift < n_gpus:
        raise DSV3Error(f"--shift must be in 1..{n_gpus - 1}")
    gpus = (order[:, None] * gpus_per_node + np.arange(gpus_per_node)[None, :]).ravel()
    src, dst = gpus, np.roll(gpus, -shift)

    def chunks() -> Iterator[Chunk]:
        yield src, dst, np.full(n_gpus, float(size_bytes))

    return Workload("permutation", chunks, size_bytes, n_gpus, 1, 1.0, {"shift": shift})


def node_order(n_nodes: int, placement: str, rng: np.random.Generator) -> np.ndarray:
    """Job placement: nodes in index order (linear) or shuffled (a fragmented allocation)."""
    if placement == "linear":
        return np.arange(n_nodes)
    if placement == "random":
        return rng.permutation(n_nodes)
    raise DSV3Error(f"--placement must be 'linear' or 'random', got {placement!r}")


def ring_groups(n_gpus: int, gpus_per_node: int, group: str, group_size: int | None,
                order: np.ndarray) -> list[np.ndarray]:
    """The rings a collective runs on.

    dp: one ring per local GPU index across nodes (rail- and plane-aligned, as data parallelism is);
    tp: rings inside a node over ``group_size`` consecutive GPUs; world: one ring over all GPUs.
    """
    G = gpus_per_node
    nodes = n_gpus // G
    if group == "dp":
        size = group_size or nodes
        if nodes % size or size < 2:
            raise DSV3Error(f"dp group size {size} must be >= 2 and divide the {nodes} nodes")
        return [order[lo:lo + size] * G + c for c in range(G) for lo in range(0, nodes, size)]
    if group == "tp":
        size = group_size or G
        if G % size or size < 2:
            raise DSV3Error(f"tp group size {size} must be >= 2 and divide {G} GPUs per node")
        return [n * G + np.arange(lo, lo + size) for n in order for lo in range(0, G, size)]
    if group == "world":
        return [(order[:, None] * G + np.arange(G)[None, :]).ravel()]
    raise DSV3Error(f"--group must be dp, tp or world, got {group!r}")


def ring_collective(kind: str, rings: list[np.ndarray], size_bytes: float) -> Workload:
    """Ring all-gather / reduce-scatter (n-1 steps of S/n) or all-reduce (2(n-1) steps of S/n)."""
    n = len(rings[0])
    steps = {"allgather": n - 1, "reducescatter": n - 1, "allreduce": 2 * (n - 1)}.get(kind)
    if steps is None:
        raise DSV3Error(f"unknown ring collective {kind!r}")
    src = np.concatenate(rings)
    dst = np.concatenate([np.roll(r, -1) for r in rings])
    factor = (2 * (n - 1) / n) if kind == "allreduce" else (n - 1) / n
    per_step = size_bytes / n

    def chunks() -> Iterator[Chunk]:
        yield src, dst, np.full(len(src), per_step)

    return Workload(kind, chunks, size_bytes, n, steps, factor, {"rings": len(rings), "ring_size": n})


def incast(n_gpus: int, gpus_per_node: int, sources: int, size_bytes: float, target: int = 0) -> Workload:
    """``sources`` GPUs on other nodes each send S to one GPU (the many-to-one pattern that fills queues)."""
    others = np.array([g for g in range(n_gpus) if g // gpus_per_node != target // gpus_per_node])
    if not 1 <= sources <= len(others):
        raise DSV3Error(f"--incast-sources must be in 1..{len(others)}")
    src = others[:sources]

    def chunks() -> Iterator[Chunk]:
        yield src, np.full(len(src), target), np.full(len(src), float(size_bytes))

    return Workload("incast", chunks, size_bytes, sources + 1, 1, 1.0, {"sources": sources, "target": target})
