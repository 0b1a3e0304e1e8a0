"""One entry point for every topology kind, and the JSON-ready description the `topology` command prints."""

from __future__ import annotations

from dataclasses import dataclass

from dsv3.errors import DSV3Error
from dsv3.network.fattree import build_ft2, build_ft3, build_mpft, build_mrft
from dsv3.network.lowdiameter import build_dragonfly, build_slimfly
from dsv3.network.topology import Topology, graph_bisection, graph_counts, graph_diameter

KINDS = ("ft2", "ft3", "mpft", "mrft", "sf", "df")


@dataclass(frozen=True)
class TopologySpec:
    """Everything needed to build a topology; unused fields are ignored by the other kinds."""

    kind: str = "mpft"
    k: int = 64
    planes: int = 8
    rails: int = 8
    q: int = 5
    p: int = 4
    a: int = 8
    h: int = 4
    g: int | None = None
    endpoints: int | None = None  # None: the largest the parameters allow
    gpus_per_node: int = 8


def build_topology(spec: TopologySpec) -> Topology:
    """Build the graph for ``spec``; bad parameters raise DSV3Error with the reason."""
    kind = spec.kind.lower()
    n, gpn = spec.endpoints, spec.gpus_per_node
    if kind == "ft2":
        return build_ft2(spec.k, n, gpn)
    if kind == "ft3":
        return build_ft3(spec.k, n, gpn)
    if kind == "mpft":
        return build_mpft(spec.k, spec.planes, n, gpn)
    if kind == "mrft":
        return build_mrft(spec.k, spec.rails, n, gpn)
    if kind == "sf":
        return build_slimfly(spec.q, n, gpn)
    if kind == "df":
        return build_dragonfly(spec.p, spec.a, spec.h, spec.g, n, gpn)
    raise DSV3Error(f"unknown topology kind {spec.kind!r}; choose one of {', '.join(KINDS)}")


def describe(topo: Topology) -> dict:
    """Counts by formula and by graph (with an agreement flag), diameter and bisection where cheap."""
    counted = graph_counts(topo.graph)
    counts = {key: {"formula": topo.formula[key], "graph": counted[key]} for key in ("endpoints", "switches", "links")}
    return {
        "kind": topo.kind,
        "params": topo.params,
        **counts,
        "counts_agree": all(c["formula"] == c["graph"] for c in counts.values()),
        "nodes": -(-topo.n_endpoints // topo.gpus_per_node),
        "planes": topo.planes,
        "diameter_switch_hops": {"formula": topo.diameter_formula, "graph": graph_diameter(topo)},
        "bisection_links": {"formula": topo.bisection_formula, "graph": _natural_cut(topo)},
        "endpoints_per_switch": round(topo.formula["endpoints"] / topo.formula["switches"], 3),
        "links_per_endpoint": round(topo.formula["links"] / topo.formula["endpoints"], 3),
        "notes": topo.notes + [
            "links count switch-to-switch links only (Table 3's convention); endpoint cables are not included",
            "diameter: switch-to-switch hops between endpoint switches (graph value omitted when large)",
            "bisection: formula = links a non-blocking split needs (E/2) or the canonical count; graph = "
            "links crossing the builder's natural half split",
        ],
    }


def _natural_cut(topo: Topology) -> int | None:
    """Links across the builder's half split; None for Slim Fly, whose builder has no natural halves."""
    has_halves = any(d.get("side") for _, d in topo.graph.nodes(data=True) if d["kind"] == "switch")
    return graph_bisection(topo.graph) if has_halves else None
