"""Build the max-min FlowSet from segments under a routing policy (adaptive, ECMP, static)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.fabric import Fabric
from dsv3.network.maxmin import FlowSet
from dsv3.network.routing import adaptive_groups, ecmp_chooser, splitmix64, static_chooser, unique_pairs, walk_paths
from dsv3.network.segments import Segments

ROUTINGS = ("adaptive", "ecmp", "static")


@dataclass
class RoutedFlows:
    flows: FlowSet
    is_network: np.ndarray  # [F] bool
    switch_hops: np.ndarray  # [F] switch-to-switch hops of each flow (0 for NVLink and same-leaf)


def build_flows(fabric: Fabric, segs: Segments, routing: str, qps: int = 1, seed: int = 0) -> RoutedFlows:
    """NVLink segments use their two NVLink links; network segments their NIC links plus a core route."""
    if routing not in ROUTINGS:
        raise DSV3Error(f"--routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if qps < 1:
        raise DSV3Error("--qps must be >= 1")
    n_q = qps if routing == "ecmp" else 1  # spraying and destination tables ignore the queue pair
    r = np.repeat(segs.net_src, n_q)
    q = np.repeat(segs.net_dst, n_q)
    qp = np.tile(np.arange(n_q, dtype=np.uint64), len(segs.net_src))
    net_bytes = np.repeat(segs.net_bytes / n_q, n_q)
    su, sv = fabric.ep_switch[r], fabric.ep_switch[q]
    cross = np.flatnonzero(su != sv)
    hops = np.zeros(len(r), dtype=np.int64)
    group = np.full(len(r), -1, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    g_link, g_group, g_weight = empty, empty, np.zeros(0)
    path = np.zeros((len(r), 0), dtype=np.int64)
    if len(cross) and routing == "adaptive":
        pu, pv, inverse = unique_pairs(su[cross], sv[cross], len(fabric.switch_names))
        g_link, g_group, g_weight, pair_hops = adaptive_groups(fabric, pu, pv)
        group[cross] = inverse
        hops[cross] = pair_hops[inverse]
    elif len(cross):
        if routing == "ecmp":
            with np.errstate(over="ignore"):
                key = (r[cross].astype(np.uint64) * np.uint64(fabric.topo.n_endpoints) + q[cross].astype(np.uint64))
                flow_hash = splitmix64(splitmix64(key) ^ (qp[cross] * np.uint64(0x51_7CC1_B727_220A_95)))
            chooser = ecmp_chooser(flow_hash, salt=seed)
        else:
            chooser = static_chooser(fabric.ep_rank[q[cross]])
        walked = walk_paths(fabric, su[cross], sv[cross], chooser)
        path = np.full((len(r), walked.shape[1]), fabric.dummy, dtype=np.int64)
        path[cross] = walked
        hops[cross] = (walked != fabric.dummy).sum(axis=1)
    width = 2 + path.shape[1]
    n_nvl = len(segs.nvl_src)
    direct = np.full((n_nvl + len(r), width), fabric.dummy, dtype=np.int64)
    direct[:n_nvl, 0], direct[:n_nvl, 1] = fabric.nvl_out[segs.nvl_src], fabric.nvl_in[segs.nvl_dst]
    direct[n_nvl:, 0], direct[n_nvl:, 1] = fabric.nic_up[r], fabric.nic_down[q]
    direct[n_nvl:, 2:] = path
    if not fabric.alive[direct].all():
        raise DSV3Error("a route uses a failed link (internal routing error)")
    flows = FlowSet(
        direct=direct,
        group=np.r_[np.full(n_nvl, -1, dtype=np.int64), group],
        g_link=g_link, g_group=g_group, g_weight=g_weight,
        nbytes=np.r_[segs.nvl_bytes, net_bytes],
        n_links=fabric.n_links + 1,
    )
    is_net = np.r_[np.zeros(n_nvl, dtype=bool), np.ones(len(r), dtype=bool)]
    return RoutedFlows(flows, is_net, np.r_[np.zeros(n_nvl, dtype=np.int64), hops])
