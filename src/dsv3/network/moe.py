"""Expert-parallel dispatch and combine traffic from real routing decisions (numpy only).

Each token is routed by a sigmoid-score, group-limited top-k router as in DeepSeek-V3: one expert group
per node, the M groups with the largest sum of their top-(k/M) scores are kept, then the top-k experts
among them. Dispatch is deduplicated as DeepEP does it: a token crosses IB once per destination node,
to the GPU with the same local index (same plane, so no cross-plane forwarding), and is forwarded over
NVLink to the other GPUs on that node that hold its experts. Combine is the same traffic reversed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.traffic import Chunk, Workload


@dataclass(frozen=True)
class EPSpec:
    tokens_per_gpu: int = 4096
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    node_limit: int = 4  # M: nodes a token may reach; 0 = no limit
    dedup: bool = True
    ep_size: int | None = None  # GPUs per EP group; None = all GPUs
    expert_skew: float = 0.0  # std of a per-expert logit offset: popular and unpopular experts

    def token_bytes(self, phase: str) -> float:
        """FP8 dispatch carries 1 B per element plus one fp32 scale per 128; BF16 combine 2 B."""
        return self.hidden + 4 * (self.hidden // 128) if phase == "dispatch" else 2.0 * self.hidden


def route_tokens(scores: np.ndarray, n_groups: int, topk: int, topk_groups: int) -> np.ndarray:
    """Group-limited top-k on sigmoid scores [T, E]: expert ids [T, topk]."""
    T, E = scores.shape
    if topk_groups and topk_groups < n_groups:
        grouped = scores.reshape(T, n_groups, E // n_groups)
        per_group = max(1, topk // topk_groups)
        group_score = -np.partition(-grouped, per_group - 1, axis=-1)[..., :per_group].sum(-1)  # [T, groups]
        keep = np.argpartition(-group_score, topk_groups - 1, axis=1)[:, :topk_groups]
        mask = np.full((T, n_groups), -np.inf)
        np.put_along_axis(mask, keep, 0.0, axis=1)
        scores = (grouped + mask[..., None]).reshape(T, E)
    return np.argpartition(-scores, topk - 1, axis=1)[:, :topk]


def _token_scores(rng: np.random.Generator, tokens: int, experts: int, bias: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(rng.standard_normal((tokens, experts)) + bias)))


def ep_workload(n_gpus: int, gpus_per_node: int, spec: EPSpec, phase: str, seed: int = 0) -> Workload:
    """EP dispatch or combine over consecutive EP groups of ``ep_size`` GPUs, all running at once."""
    if phase not in ("dispatch", "combine"):
        raise DSV3Error(f"EP phase must be dispatch or combine, got {phase!r}")
    G = gpus_per_node
    ep = spec.ep_size or n_gpus
    if ep % G or n_gpus % ep or ep < G:
        raise DSV3Error(f"--ep {ep} must be a multiple of {G} GPUs per node and divide {n_gpus} GPUs")
    nodes = ep // G
    if spec.experts % ep:
        raise DSV3Error(f"{spec.experts} experts cannot be spread evenly over an EP group of {ep} GPUs; "
                        f"set --ep to a divisor of the expert count (e.g. 64) or change --experts")
    if not 1 <= spec.topk <= spec.experts:
        raise DSV3Error("--topk must be between 1 and the number of experts")
    limit = spec.node_limit if spec.node_limit and spec.node_limit < nodes else 0
    per_gpu = spec.experts // ep
    tb = spec.token_bytes(phase)
    info = {"tokens_per_gpu": spec.tokens_per_gpu, "ep_size": ep, "nodes_per_ep_group": nodes,
            "node_limit": limit or None, "dedup": spec.dedup, "token_bytes": tb, "phase": phase}
    totals = {"ib_copies": 0, "tokens": 0, "gpu_fanout": 0, "nodes_touched": 0}

    def chunks() -> Iterator[Chunk]:
        rng = np.random.default_rng(seed)
        bias = spec.expert_skew * rng.standard_normal(spec.experts)
        for base in range(0, n_gpus, ep):
            for s in range(ep):
                experts = route_tokens(_token_scores(rng, spec.tokens_per_gpu, spec.experts, bias), nodes,
                                       spec.topk, limit)
                src, dst, count = _token_transfers(s, experts // per_gpu, G, nodes, spec.dedup, totals)
                src, dst = src + base, dst + base
                if phase == "combine":
                    src, dst = dst, src
                yield src, dst, count * tb
        info["ib_copies_per_token"] = totals["ib_copies"] / max(1, totals["tokens"])
        info["internode_bytes_per_token"] = info["ib_copies_per_token"] * tb
        info["gpus_per_token"] = totals["gpu_fanout"] / max(1, totals["tokens"])
        info["nodes_per_token"] = totals["nodes_touched"] / max(1, totals["tokens"])
        info["logical_bytes_per_gpu"] = totals["gpu_fanout"] / max(1, totals["tokens"]) * spec.tokens_per_gpu * tb

    return Workload(f"ep-{phase}", chunks, 0.0, ep, 1, 1.0, info)


def _token_transfers(s: int, gpu: np.ndarray, G: int, nodes: int, dedup: bool, totals: dict):
    """Per-pair token counts for one source GPU's tokens; gpu: [T, k] destination GPU of each expert."""
    T = gpu.shape[0]
    n = nodes * G
    a, i = divmod(s, G)
    gpu = np.sort(gpu, axis=1)
    first = np.ones_like(gpu, dtype=bool)
    first[:, 1:] = gpu[:, 1:] != gpu[:, :-1]  # one copy per destination GPU
    node = gpu // G
    node_first = np.ones_like(gpu, dtype=bool)
    node_first[:, 1:] = node[:, 1:] != node[:, :-1]
    remote = node != a
    ib = (node_first if dedup else first) & remote  # copies crossing the network
    relay = node * G + i  # same local index on the destination node: same plane
    forward = first & remote & (gpu != relay)
    local = first & ~remote & (gpu != s)
    totals["tokens"] += T
    totals["ib_copies"] += int(ib.sum())
    totals["gpu_fanout"] += int((first & (gpu != s)).sum())
    totals["nodes_touched"] += int(node_first.sum())
    pairs = [
        (np.full(int(ib.sum()), s), relay[ib]),
        (relay[forward], gpu[forward]),
        (np.full(int(local.sum()), s), gpu[local]),
    ]
    src = np.concatenate([p[0] for p in pairs])
    dst = np.concatenate([p[1] for p in pairs])
    keys, counts = np.unique(src * n + dst, return_counts=True)
    return keys // n, keys % n, counts.astype(float)
