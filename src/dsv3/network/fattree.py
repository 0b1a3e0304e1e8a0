"""Fat-tree builders: two-layer (FT2), three-layer k-ary (FT3), multi-plane (MPFT), multi-rail (MRFT).

Every builder can populate part of the tree (``endpoints`` below the maximum): it then builds only the
leaves (and pods) the endpoints need, with all k/2 spines (or (k/2)^2 cores) so the part stays
non-blocking. Closed forms are computed independently of the graph so tests can compare the two.
"""

from __future__ import annotations

import networkx as nx

from dsv3.errors import DSV3Error
from dsv3.network.topology import (
    ENDPOINT_NODE_LIMIT,
    Topology,
    add_link,
    add_switch,
    attach_endpoints,
    ceil_div,
    check_radix,
)


def _check_nodes(endpoints: int, gpus_per_node: int) -> None:
    if endpoints < 1 or endpoints % gpus_per_node:
        raise DSV3Error(f"endpoints ({endpoints}) must be a positive multiple of gpus per node ({gpus_per_node})")


def ft2_formula(k: int, endpoints: int) -> dict[str, int]:
    """Leaf-spine: ceil(E/(k/2)) leaves, k/2 spines (when > 1 leaf), every leaf wired to every spine."""
    leaves = ceil_div(endpoints, k // 2)
    spines = k // 2 if leaves > 1 else 0
    return {"endpoints": endpoints, "switches": leaves + spines, "links": leaves * spines}


def _leaf_spine(g: nx.Graph, k: int, n_endpoints: int, plane: int, rails: int = 1) -> list[tuple]:
    """Build one leaf-spine plane and return the leaf names in order; each rail gets its own leaves."""
    per_rail = ceil_div(n_endpoints // rails, k // 2)
    n_leaves = per_rail * rails
    if n_leaves > k:
        raise DSV3Error(
            f"a two-layer fat tree of radix {k} holds at most {k * k // 2} endpoints; use ft3 or mpft"
        )
    leaves = [("leaf", plane, i) for i in range(n_leaves)]
    spines = [("spine", plane, s) for s in range(k // 2)] if n_leaves > 1 else []
    for i, leaf in enumerate(leaves):
        add_switch(g, leaf, "leaf", plane, side=int(i >= n_leaves / 2))
    for s, spine in enumerate(spines):
        add_switch(g, spine, "spine", plane, side=int(s >= len(spines) / 2))
    for leaf in leaves:
        for spine in spines:
            add_link(g, leaf, spine)
    return leaves


def build_ft2(k: int = 64, endpoints: int | None = None, gpus_per_node: int = 8) -> Topology:
    """Two-layer non-blocking leaf-spine: k leaves x k/2 spines at full size, k^2/2 endpoints."""
    check_radix(k)
    endpoints = endpoints or k * k // 2
    _check_nodes(endpoints, gpus_per_node)
    g = nx.Graph()
    leaves = _leaf_spine(g, k, endpoints, plane=0)
    topo = _fat_topology("ft2", {"k": k}, g, ft2_formula(k, endpoints), endpoints, gpus_per_node, planes=1)
    attach_endpoints(topo, [leaves[e // (k // 2)] for e in range(endpoints)], endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def build_mpft(k: int = 64, planes: int = 8, endpoints: int | None = None, gpus_per_node: int = 8) -> Topology:
    """``planes`` independent FT2s; GPU i of every node (and its NIC) sits in plane i % planes."""
    check_radix(k)
    if planes < 1 or gpus_per_node % planes:
        raise DSV3Error(f"planes ({planes}) must divide gpus per node ({gpus_per_node})")
    endpoints = endpoints or planes * k * k // 2
    _check_nodes(endpoints, gpus_per_node)
    per_plane = endpoints // planes
    g = nx.Graph()
    leaves = [_leaf_spine(g, k, per_plane, plane=p) for p in range(planes)]
    one = ft2_formula(k, per_plane)
    formula = {key: planes * v for key, v in one.items()}
    topo = _fat_topology("mpft", {"k": k, "planes": planes}, g, formula, endpoints, gpus_per_node, planes)
    per_node = gpus_per_node // planes  # NICs a node has in each plane
    switches = []
    for e in range(endpoints):
        node, local = divmod(e, gpus_per_node)
        index_in_plane = node * per_node + local // planes
        switches.append(leaves[local % planes][index_in_plane // (k // 2)])
    attach_endpoints(topo, switches, endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def mrft_formula(k: int, rails: int, endpoints: int) -> dict[str, int]:
    leaves = rails * ceil_div(endpoints // rails, k // 2)
    spines = k // 2 if leaves > 1 else 0
    return {"endpoints": endpoints, "switches": leaves + spines, "links": leaves * spines}


def build_mrft(k: int = 64, rails: int = 8, endpoints: int | None = None, gpus_per_node: int = 8) -> Topology:
    """One leaf-spine fabric whose leaves are rail-dedicated: NIC i of each node goes to a rail-i leaf."""
    check_radix(k)
    if rails < 1 or gpus_per_node % rails:
        raise DSV3Error(f"rails ({rails}) must divide gpus per node ({gpus_per_node})")
    endpoints = endpoints or k * k // 2
    _check_nodes(endpoints, gpus_per_node)
    g = nx.Graph()
    leaves = _leaf_spine(g, k, endpoints, plane=0, rails=rails)
    per_rail_leaves = len(leaves) // rails
    topo = _fat_topology("mrft", {"k": k, "rails": rails}, g, mrft_formula(k, rails, endpoints), endpoints,
                         gpus_per_node, planes=1)
    per_node = gpus_per_node // rails
    switches = []
    for e in range(endpoints):
        node, local = divmod(e, gpus_per_node)
        index_in_rail = node * per_node + local // rails
        switches.append(leaves[(local % rails) * per_rail_leaves + index_in_rail // (k // 2)])
    attach_endpoints(topo, switches, endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def ft3_formula(k: int, endpoints: int) -> dict[str, int]:
    """k-ary fat tree (Al-Fares): k pods of k/2 edge + k/2 aggregation switches, (k/2)^2 cores."""
    h = k // 2
    edges = ceil_div(endpoints, h)
    pods = ceil_div(edges, h)
    aggs = pods * h if edges > 1 else 0
    cores = h * h if pods > 1 else 0
    links = edges * h * (edges > 1) + aggs * h * (pods > 1)
    return {"endpoints": endpoints, "switches": edges + aggs + cores, "links": links}


def build_ft3(k: int = 64, endpoints: int | None = None, gpus_per_node: int = 8) -> Topology:
    """Three-layer k-ary fat tree, k^3/4 endpoints at full size; core (a, c) joins aggregation a of every pod."""
    check_radix(k)
    h = k // 2
    endpoints = endpoints or k**3 // 4
    _check_nodes(endpoints, gpus_per_node)
    n_edges = ceil_div(endpoints, h)
    n_pods = ceil_div(n_edges, h)
    if n_pods > k:
        raise DSV3Error(f"a three-layer fat tree of radix {k} holds at most {k**3 // 4} endpoints")
    g = nx.Graph()
    edges = [("edge", i // h, i % h) for i in range(n_edges)]
    # natural half split: by pod, or inside the single pod by edge / aggregation index
    for i, name in enumerate(edges):
        add_switch(g, name, "edge", side=int(name[1] >= n_pods / 2 if n_pods > 1 else i >= n_edges / 2))
    if n_edges > 1:
        for pod in range(n_pods):
            for a in range(h):
                add_switch(g, ("agg", pod, a), "agg", side=int(pod >= n_pods / 2 if n_pods > 1 else a >= h / 2))
        for name in edges:
            for a in range(h):
                add_link(g, name, ("agg", name[1], a))
    if n_pods > 1:
        for a in range(h):
            for c in range(h):
                add_switch(g, ("core", a, c), "core", side=int(a >= h / 2))
                for pod in range(n_pods):
                    add_link(g, ("agg", pod, a), ("core", a, c))
    topo = _fat_topology("ft3", {"k": k}, g, ft3_formula(k, endpoints), endpoints, gpus_per_node, planes=1)
    topo.diameter_formula = 4 if n_pods > 1 else (2 if n_edges > 1 else 0)
    attach_endpoints(topo, [edges[e // h] for e in range(endpoints)], endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def _fat_topology(kind: str, params: dict, g: nx.Graph, formula: dict, endpoints: int, gpus_per_node: int,
                  planes: int) -> Topology:
    """Common record for the fat trees: non-blocking, so the bisection is half the endpoints' links."""
    leaves_per_plane = formula["switches"] // planes - (params["k"] // 2 if formula["links"] else 0)
    return Topology(
        kind=kind,
        params={**params, "endpoints": endpoints, "gpus_per_node": gpus_per_node},
        graph=g,
        formula=formula,
        diameter_formula=2 if leaves_per_plane > 1 else 0,
        bisection_formula=endpoints // 2 if formula["links"] else 0,
        gpus_per_node=gpus_per_node,
        planes=planes,
    )
