"""The Topology record every builder returns, and the helpers that count and measure its graph.

A topology is a networkx graph whose nodes carry ``kind`` ("switch", "endpoint", "nvswitch") and whose
edges carry ``kind`` ("link" between switches, "nic" from an endpoint to its switch, "nvlink" from a GPU
to its node's NVSwitch). Table 3 counts endpoints, switches, and switch-to-switch links only, so those
are what :func:`graph_counts` counts; the builder also states the same three numbers by closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from dsv3.errors import DSV3Error

# Builders skip per-endpoint graph nodes above this size and record them as a count on each switch
# (attribute ``terminals``) so a 261,632-endpoint Dragonfly still builds in seconds.
ENDPOINT_NODE_LIMIT = 70_000


@dataclass
class Topology:
    """A built network: the graph, its closed-form counts, and what the simulator needs to route on it."""

    kind: str
    params: dict[str, int]
    graph: nx.Graph
    formula: dict[str, int]  # endpoints, switches, links (switch-to-switch), by closed form
    diameter_formula: int | None  # switch-to-switch hops between the farthest endpoint switches
    bisection_formula: int | None  # links crossing the natural half split
    gpus_per_node: int = 8
    planes: int = 1  # > 1: NIC i of a node reaches only plane i % planes (MPFT)
    endpoint_switch: list = field(default_factory=list)  # endpoint index -> switch node it plugs into
    notes: list[str] = field(default_factory=list)

    @property
    def n_endpoints(self) -> int:
        return len(self.endpoint_switch)

    def plane_of(self, endpoint: int) -> int:
        return (endpoint % self.gpus_per_node) % self.planes


def add_switch(g: nx.Graph, name: tuple, role: str, plane: int = 0, side: int = 0) -> None:
    """A switch node; ``side`` is 0/1 for the natural half split used to count bisection links."""
    g.add_node(name, kind="switch", role=role, plane=plane, side=side, terminals=0)


def add_link(g: nx.Graph, u: tuple, v: tuple, cls: str = "global") -> None:
    """A switch-to-switch link; ``cls`` lets the cost model price short (local) links differently."""
    g.add_edge(u, v, kind="link", cls=cls)


def attach_endpoints(topo: Topology, switches: list, with_nodes: bool) -> None:
    """Plug endpoint i into switches[i]: as a graph node with a 'nic' edge, or as a count on the switch."""
    g = topo.graph
    topo.endpoint_switch = list(switches)
    for i, sw in enumerate(switches):
        g.nodes[sw]["terminals"] += 1
        if with_nodes:
            g.add_node(("ep", i), kind="endpoint", node=i // topo.gpus_per_node)
            g.add_edge(("ep", i), sw, kind="nic")


def add_nvlink(topo: Topology) -> None:
    """One NVSwitch per compute node, linked to each of its GPUs (the scale-up domain)."""
    g = topo.graph
    for i in range(topo.n_endpoints):
        nvs = ("nvs", i // topo.gpus_per_node)
        if nvs not in g:
            g.add_node(nvs, kind="nvswitch")
        if ("ep", i) in g:
            g.add_edge(("ep", i), nvs, kind="nvlink")


def graph_counts(g: nx.Graph) -> dict[str, int]:
    """Endpoints, switches and switch-to-switch links by counting the graph (Table 3's definitions)."""
    switches = [n for n, d in g.nodes(data=True) if d["kind"] == "switch"]
    endpoint_nodes = sum(1 for _, d in g.nodes(data=True) if d["kind"] == "endpoint")
    terminals = sum(g.nodes[s]["terminals"] for s in switches)
    links = sum(1 for *_, d in g.edges(data=True) if d["kind"] == "link")
    return {"endpoints": endpoint_nodes or terminals, "switches": len(switches), "links": links}


def switch_graph(g: nx.Graph, plane: int | None = None) -> nx.Graph:
    """The switches and their links only (optionally one plane), as a simple graph."""
    keep = [n for n, d in g.nodes(data=True) if d["kind"] == "switch" and (plane is None or d["plane"] == plane)]
    return nx.Graph(g.subgraph(keep))


def graph_diameter(topo: Topology, max_switches: int = 400) -> int | None:
    """Largest switch-hop distance between switches that host endpoints; None when too big to BFS."""
    sg = switch_graph(topo.graph, plane=0 if topo.planes > 1 else None)
    hosts = [n for n in sg if topo.graph.nodes[n]["terminals"] > 0]
    if len(sg) > max_switches or len(hosts) < 2:
        return None if len(hosts) >= 2 else 0
    worst = 0
    for src in hosts:
        dist = nx.single_source_shortest_path_length(sg, src)
        worst = max(worst, max(dist[h] for h in hosts))
    return worst


def graph_bisection(g: nx.Graph) -> int:
    """Links between the two halves of the builder's natural split (the ``side`` attribute)."""
    return sum(
        1 for u, v, d in g.edges(data=True) if d["kind"] == "link" and g.nodes[u]["side"] != g.nodes[v]["side"]
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_radix(k: int) -> None:
    """Fat trees split each switch's ports half down, half up, so the radix must be even."""
    if k < 2 or k % 2:
        raise DSV3Error(f"switch radix must be an even number >= 2, got {k}")
