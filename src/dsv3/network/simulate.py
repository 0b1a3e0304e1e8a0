"""Run one traffic pattern over one topology: build, fail, route, drain, and measure.

Time of a phase = latency (Table 5, per hop) + fluid time (max-min fair rates, event by event). A ring
collective repeats its phase once per step. Reported bandwidths follow NCCL-tests: algbw = S / time,
busbw = algbw x the collective's factor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.catalog import TopologySpec, build_topology, describe
from dsv3.network.fabric import LINK_KIND_NAMES, NIC_DOWN, NIC_UP, NVLINK, SWITCH, Fabric, LinkSpeeds
from dsv3.network.flowset import build_flows
from dsv3.network.maxmin import drain
from dsv3.network.moe import EPSpec, ep_workload
from dsv3.network.segments import SegmentBuilder
from dsv3.network.traffic import Workload, alltoall, incast, node_order, permutation, ring_collective, ring_groups

TRAFFICS = ("alltoall", "permutation", "allgather", "reducescatter", "allreduce", "incast", "ep-dispatch", "ep-combine")

# Table 5 (64 B, end to end): same leaf / cross leaf, microseconds; NVLink 3.33 us.
TABLE5_US = {"ib": (2.8, 3.7), "roce": (3.6, 5.6)}
NVLINK_US = 3.33


@dataclass(frozen=True)
class SimConfig:
    topology: TopologySpec = TopologySpec()
    traffic: str = "alltoall"
    routing: str = "adaptive"
    message_bytes: float = 256 * 2**20
    fail_plane: int | None = None
    fail_links: int = 0
    fail_switches: int = 0
    speeds: LinkSpeeds = LinkSpeeds()
    link_layer: str = "ib"
    qps: int = 1
    relay: str = "source"
    pxn: bool = False
    group: str = "dp"
    group_size: int | None = None
    placement: str = "linear"
    incast_sources: int = 8
    shift: int | None = None
    ep: EPSpec = field(default_factory=EPSpec)
    seed: int = 0
    rtol: float = 1e-3  # 0: exact max-min and event times; 1e-3 keeps large ECMP runs fast (<= 0.1% error)


def hop_latency_us(link_layer: str, switch_hops: np.ndarray) -> np.ndarray:
    """Table 5 as an alpha model: same-leaf latency plus half the cross-leaf increment per switch hop."""
    if link_layer not in TABLE5_US:
        raise DSV3Error(f"--link-layer must be ib or roce, got {link_layer!r}")
    same, cross = TABLE5_US[link_layer]
    return same + (cross - same) / 2 * switch_hops


def make_workload(cfg: SimConfig, n_gpus: int, gpus_per_node: int) -> Workload:
    kind = cfg.traffic
    if cfg.message_bytes <= 0 and not kind.startswith("ep-"):
        raise DSV3Error("--message-bytes must be positive")
    if kind == "alltoall":
        return alltoall(n_gpus, cfg.message_bytes)
    order = node_order(-(-n_gpus // gpus_per_node), cfg.placement, np.random.default_rng(cfg.seed))
    if kind == "permutation":
        return permutation(n_gpus, cfg.message_bytes, cfg.shift, order, gpus_per_node)
    if kind in ("allgather", "reducescatter", "allreduce"):
        rings = ring_groups(n_gpus, gpus_per_node, cfg.group, cfg.group_size, order)
        return ring_collective(kind, rings, cfg.message_bytes)
    if kind == "incast":
        return incast(n_gpus, gpus_per_node, cfg.incast_sources, cfg.message_bytes)
    if kind in ("ep-dispatch", "ep-combine"):
        return ep_workload(n_gpus, gpus_per_node, cfg.ep, kind.split("-")[1], cfg.seed)
    raise DSV3Error(f"--traffic must be one of {', '.join(TRAFFICS)}, got {kind!r}")


def apply_failures(fabric: Fabric, cfg: SimConfig) -> dict:
    rng = np.random.default_rng(cfg.seed + 7919)
    out: dict = {}
    if cfg.fail_plane is not None:
        fabric.fail_plane(cfg.fail_plane)
        out["plane"] = cfg.fail_plane
    if cfg.fail_links < 0 or cfg.fail_switches < 0:
        raise DSV3Error("--fail-links and --fail-switches must be >= 0")
    if cfg.fail_links:
        out["links"] = len(fabric.fail_random_links(cfg.fail_links, rng))
    if cfg.fail_switches:
        out["switches"] = [str(s) for s in fabric.fail_random_switches(cfg.fail_switches, rng)]
    return out


def _utilization_stats(util: np.ndarray) -> dict:
    if len(util) == 0:
        return {"links": 0}
    counts, edges = np.histogram(np.clip(util, 0, 1), bins=10, range=(0, 1))
    return {
        "links": int(len(util)),
        "mean": float(util.mean()), "p50": float(np.percentile(util, 50)), "p90": float(np.percentile(util, 90)),
        "max": float(util.max()), "idle_fraction": float((util <= 1e-9).mean()),
        "histogram": {"bin_edges": [round(x, 2) for x in edges.tolist()], "counts": counts.tolist()},
    }


Progress = Callable[[str, float], None]


def run_simulation(cfg: SimConfig, progress: Progress | None = None, keep_arrays: bool = False) -> dict:
    """Simulate ``cfg`` and return a JSON-ready report (plus raw arrays when ``keep_arrays``)."""
    started = time.perf_counter()
    report_progress = progress or (lambda stage, frac: None)
    topo = build_topology(cfg.topology)
    fabric = Fabric(topo, cfg.speeds)
    failures = apply_failures(fabric, cfg)
    n_gpus, G = topo.n_endpoints, topo.gpus_per_node
    workload = make_workload(cfg, n_gpus, G)
    builder = SegmentBuilder(fabric, relay=cfg.relay, pxn=cfg.pxn)
    for i, (src, dst, nbytes) in enumerate(workload.chunks()):
        builder.add(src, dst, nbytes)
        report_progress("traffic", min(1.0, (i + 1) * 64 / max(n_gpus, 1)))
    segs = builder.build()
    routed = build_flows(fabric, segs, cfg.routing, cfg.qps, cfg.seed)
    built = time.perf_counter()
    result = drain(routed.flows, fabric.capacity, cfg.rtol, progress=lambda f: report_progress("drain", f))
    fluid = float(result.finish.max(initial=0.0))
    net = routed.is_network
    if net.any():
        alpha = float(hop_latency_us(cfg.link_layer, routed.switch_hops[net]).max())
        alpha += NVLINK_US * segs.stats["max_nvlink_hops"]
    else:
        alpha = NVLINK_US
    step_time = alpha * 1e-6 + fluid
    total = workload.steps * step_time
    size = workload.size_bytes or workload.info.get("logical_bytes_per_gpu", 0.0)
    algbw = size / total / 1e9 if total > 0 else 0.0

    link_bytes = routed.flows.link_load(routed.flows.nbytes)[: fabric.n_links]
    util = link_bytes / fabric.capacity[: fabric.n_links] / fluid if fluid > 0 else np.zeros(fabric.n_links)
    live = fabric.alive[: fabric.n_links]
    kinds = fabric.kind[: fabric.n_links]
    nic_tx = np.bincount(segs.net_src, weights=segs.net_bytes, minlength=n_gpus)
    nic_rx = np.bincount(segs.net_dst, weights=segs.net_bytes, minlength=n_gpus)
    report = {
        "topology": {k: v for k, v in describe_small(topo).items()},
        "traffic": {"kind": workload.name, "size_bytes": size, "ranks": workload.ranks, "steps": workload.steps,
                    **workload.info},
        "routing": cfg.routing,
        "gpus": n_gpus,
        "failures": failures,
        "time_us": total * 1e6,
        "step": {"fluid_us": fluid * 1e6, "latency_us": alpha},
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * workload.busbw_factor,
        "nic": {
            "tx_GBps_mean": float(nic_tx.mean() / step_time / 1e9) if step_time else 0.0,
            "tx_GBps_max": float(nic_tx.max() / step_time / 1e9) if step_time else 0.0,
            "rx_GBps_mean": float(nic_rx.mean() / step_time / 1e9) if step_time else 0.0,
            "line_rate_GBps": cfg.speeds.nic_gbps / 8,
        },
        "bytes": {"total": segs.stats["bytes"], "internode": segs.stats["internode_bytes"],
                  "network": float(segs.net_bytes.sum()), "nvlink": float(segs.nvl_bytes.sum()),
                  "forwarded_over_nvlink": segs.stats["forwarded_nvlink_bytes"]},
        "link_utilization": {
            LINK_KIND_NAMES[k]: _utilization_stats(util[live & (kinds == k)])
            for k in (SWITCH, NIC_UP, NIC_DOWN, NVLINK)
        },
        "flows": {"transfers": segs.stats["transfers"], "relayed_transfers": segs.stats["relayed_transfers"],
                  "nvlink_segments": int(len(segs.nvl_src)), "network_flows": int(net.sum()),
                  "events": result.events, "fill_iterations": result.iterations},
        "wall_s": {"build": built - started, "drain": time.perf_counter() - built,
                   "total": time.perf_counter() - started},
        "model": "flow-level max-min fair (progressive filling); forwarded transfers pipeline their NVLink "
                 "and network segments; latency per Table 5",
    }
    if keep_arrays:
        report["_arrays"] = {"util": util, "live": live, "kinds": kinds}
    return report


def describe_small(topo) -> dict:
    """The topology summary a simulation report carries (no graph-wide diameter search)."""
    d = describe(topo) if topo.n_endpoints <= 4096 else {"kind": topo.kind, "params": topo.params}
    return {k: d[k] for k in ("kind", "params", "endpoints", "switches", "links") if k in d}


def sweep(base: SimConfig, kinds: list[str], gpu_counts: list[int], sizes: list[float], routings: list[str],
          progress: Progress | None = None) -> list[dict]:
    """Bandwidth over topologies x GPU counts x routings x message sizes.

    One simulation per (kind, GPUs, routing): the fluid time scales exactly with the message size
    (every flow scales, so rates and event order do not change), and the latency is added per step.
    """
    rows = []
    for kind in kinds:
        for n in gpu_counts:
            for routing in routings:
                cfg = replace(base, routing=routing, message_bytes=sizes[-1],
                              topology=replace(base.topology, kind=kind, endpoints=n))
                rep = run_simulation(cfg, progress)
                steps, fluid, alpha = rep["traffic"]["steps"], rep["step"]["fluid_us"], rep["step"]["latency_us"]
                factor = rep["busbw_GBps"] / rep["algbw_GBps"] if rep["algbw_GBps"] else 1.0
                for s in sizes:
                    t_us = steps * (alpha + fluid * s / sizes[-1])
                    algbw = s / (t_us * 1e-6) / 1e9
                    rows.append({"topology": kind, "gpus": n, "routing": routing, "message_bytes": s,
                                 "time_us": t_us, "algbw_GBps": algbw, "busbw_GBps": algbw * factor})
    return rows
