"""Low-diameter topologies: Slim Fly (MMS graph, diameter 2) and Dragonfly (diameter 3).

Slim Fly follows Besta & Hoefler (SC14): two families of q^2 routers over GF(q), q = 4w + delta a prime
power. Dragonfly follows Kim, Dally, Scott & Abts (ISCA 2008): groups of a fully meshed routers with p
endpoints and h global ports each; g groups, at most a*h + 1 (one global link per pair of groups).
"""

from __future__ import annotations

import math

import networkx as nx

from dsv3.errors import DSV3Error
from dsv3.network.fields import galois_field, prime_power
from dsv3.network.topology import ENDPOINT_NODE_LIMIT, Topology, add_link, add_switch, attach_endpoints


def slimfly_delta(q: int) -> int:
    """delta in q = 4w + delta; q = 2 (mod 4) has none, so such q give no MMS graph."""
    delta = {1: 1, 3: -1, 0: 0}.get(q % 4)
    if delta is None or q < 3:
        raise DSV3Error(f"Slim Fly needs q = 4w + delta with delta in {{-1, 0, 1}} and q >= 3; got q = {q}")
    return delta


def slimfly_formula(q: int) -> dict[str, int]:
    """Routers 2q^2, network radix k' = (3q - delta)/2, p = ceil(k'/2) endpoints per router."""
    delta = slimfly_delta(q)
    k_net = (3 * q - delta) // 2
    p = math.ceil(k_net / 2)
    routers = 2 * q * q
    return {"endpoints": p * routers, "switches": routers, "links": routers * k_net // 2,
            "network_radix": k_net, "endpoints_per_router": p, "radix": k_net + p, "delta": delta}


def _generator_sets(q: int, delta: int, power) -> tuple[set[int], set[int]]:
    """MMS generator sets X (for family 0) and X' (family 1) as field elements, per SC14 Sec. 3."""
    w = (q - delta) // 4
    if delta == 1:
        ex, ex2 = range(0, q - 2, 2), range(1, q - 1, 2)
    elif delta == -1:
        ex = [*range(0, 2 * w - 1, 2), *range(2 * w - 1, 4 * w - 2, 2)]
        ex2 = [*range(1, 2 * w, 2), *range(2 * w, 4 * w - 1, 2)]
    else:
        ex, ex2 = range(0, q - 1, 2), range(1, q, 2)
    return {power(e) for e in ex}, {power(e) for e in ex2}


def build_slimfly(q: int, endpoints: int | None = None, gpus_per_node: int = 8) -> Topology:
    """The MMS Slim Fly over GF(q); raises DSV3Error for q that is not a prime power (e.g. Table 3's 28)."""
    if prime_power(q) is None:
        raise DSV3Error(
            f"q = {q} is not a prime power, so no MMS Slim Fly exists (Table 3's SF row evaluates the "
            f"formula at q = 28; see `dsv3 net cost`); nearby prime powers: 25, 27, 29, 31, 32"
        )
    f = slimfly_formula(q)
    gf = galois_field(q)
    xs, xs2 = _generator_sets(q, f["delta"], lambda e: gf.power(gf.primitive, e))
    g = nx.Graph()
    routers = [(0, x, y) for x in range(q) for y in range(q)] + [(1, m, c) for m in range(q) for c in range(q)]
    for r in routers:
        add_switch(g, ("router", *r), "router")
    for a in range(q):
        for b in range(q):
            for e in xs:
                add_link(g, ("router", 0, a, b), ("router", 0, a, int(gf.add[b, e])))
            for e in xs2:
                add_link(g, ("router", 1, a, b), ("router", 1, a, int(gf.add[b, e])))
    for x in range(q):
        for m in range(q):
            for c in range(q):
                y = int(gf.add[gf.mul[m, x], c])  # y = m*x + c
                add_link(g, ("router", 0, x, y), ("router", 1, m, c))
    capacity = f["endpoints"]
    endpoints = _check_endpoints(endpoints or capacity, capacity, gpus_per_node)
    topo = Topology(
        kind="sf", params={"q": q, "endpoints": endpoints, "gpus_per_node": gpus_per_node},
        graph=g, formula={k: f[k] for k in ("endpoints", "switches", "links")},
        diameter_formula=2, bisection_formula=None, gpus_per_node=gpus_per_node,
        notes=[f"q = {q}, delta = {f['delta']}: network radix {f['network_radix']}, "
               f"{f['endpoints_per_router']} endpoints per router, radix used {f['radix']}"],
    )
    if endpoints != capacity:
        topo.formula["endpoints"] = endpoints
    p = f["endpoints_per_router"]
    attach_endpoints(topo, [("router", *routers[e // p]) for e in range(endpoints)],
                     endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def dragonfly_formula(p: int, a: int, h: int, g: int) -> dict[str, int]:
    local, glob = g * a * (a - 1) // 2, g * a * h // 2
    return {"endpoints": p * a * g, "switches": a * g, "links": local + glob,
            "local_links": local, "global_links": glob, "radix": p + a - 1 + h}


def _global_pairs(a: int, h: int, g: int) -> list[tuple[int, int, int, int]]:
    """Global links as (group, router, group, router), using every one of each group's a*h ports.

    One link per pair of groups first (port i -> group (i + port + 1) mod g, the standard consecutive
    arrangement); ports left over when g < a*h + 1 double up on neighbouring groups, as Table 3's count
    g*a*h/2 implies.
    """
    ports = a * h
    spare = ports - (g - 1)
    if spare < 0:
        raise DSV3Error(f"dragonfly with a*h = {ports} global ports per group allows at most {ports + 1} groups")
    if spare % 2 and g % 2:
        raise DSV3Error(f"dragonfly: g = {g} groups cannot use all {ports} global ports of each group")
    out = []
    for i in range(g):
        for port in range(g - 1):
            j = (i + port + 1) % g
            if i < j:
                out.append((i, port // h, j, ((i - j - 1) % g) // h))
        for m in range(spare // 2):
            j = (i + m + 1) % g
            out.append((i, (g - 1 + 2 * m) // h, j, (g + 2 * m) // h))
        if spare % 2 and i < g // 2:
            port = ports - 1
            out.append((i, port // h, i + g // 2, port // h))
    return out


def build_dragonfly(p: int, a: int, h: int, g: int | None = None, endpoints: int | None = None,
                    gpus_per_node: int = 8) -> Topology:
    """Canonical Dragonfly; g defaults to a*h + 1. Local links are tagged 'local' for the cost model."""
    if min(p, a, h) < 1:
        raise DSV3Error("dragonfly needs p, a, h >= 1")
    g = g or a * h + 1
    if g < 2:
        raise DSV3Error("dragonfly needs at least 2 groups")
    f = dragonfly_formula(p, a, h, g)
    graph = nx.MultiGraph()
    for grp in range(g):
        for r in range(a):
            add_switch(graph, ("router", grp, r), "router", side=int(grp >= g / 2))
        for r in range(a):
            for s in range(r + 1, a):
                add_link(graph, ("router", grp, r), ("router", grp, s), cls="local")
    for gi, ri, gj, rj in _global_pairs(a, h, g):
        add_link(graph, ("router", gi, ri), ("router", gj, rj), cls="global")
    canonical = g == a * h + 1
    endpoints = _check_endpoints(endpoints or f["endpoints"], f["endpoints"], gpus_per_node)
    topo = Topology(
        kind="df", params={"p": p, "a": a, "h": h, "g": g, "endpoints": endpoints, "gpus_per_node": gpus_per_node},
        graph=graph, formula={k: f[k] for k in ("endpoints", "switches", "links")},
        diameter_formula=3 if a > 1 else 2,
        bisection_formula=(g // 2) * (g - g // 2) if canonical else None,
        gpus_per_node=gpus_per_node,
        notes=[] if canonical else [f"g = {g} is not the canonical a*h + 1 = {a * h + 1}; "
                                    f"{a * h - (g - 1)} spare global ports per group double up on neighbours"],
    )
    topo.formula["endpoints"] = endpoints
    attach_endpoints(topo, [("router", e // (p * a), (e // p) % a) for e in range(endpoints)],
                     endpoints <= ENDPOINT_NODE_LIMIT)
    return topo


def _check_endpoints(endpoints: int, capacity: int, gpus_per_node: int) -> int:
    if endpoints > capacity:
        raise DSV3Error(f"this topology holds {capacity} endpoints, asked for {endpoints}")
    if endpoints < 1:
        raise DSV3Error("need at least one endpoint")
    return endpoints
