"""Topology counts: closed form vs the built graph, Table 3 exactly, diameters and bisections."""

import pytest

from dsv3.errors import DSV3Error
from dsv3.network.catalog import TopologySpec, build_topology, describe
from dsv3.network.cost import table3_rows
from dsv3.network.fields import galois_field, prime_power
from dsv3.network.lowdiameter import slimfly_formula
from dsv3.network.topology import graph_counts, graph_diameter, switch_graph


def _agree(topo) -> dict:
    counted = graph_counts(topo.graph)
    for key in ("endpoints", "switches", "links"):
        assert counted[key] == topo.formula[key], (topo.kind, key)
    return counted


@pytest.mark.parametrize("k", [4, 8, 16, 32, 64])
def test_fat_tree_closed_forms_match_graph(k):
    ft2 = build_topology(TopologySpec("ft2", k=k))
    assert _agree(ft2) == {"endpoints": k * k // 2, "switches": 3 * k // 2, "links": k * k // 2}
    mpft = build_topology(TopologySpec("mpft", k=k, planes=8))
    assert _agree(mpft) == {"endpoints": 8 * k * k // 2, "switches": 8 * 3 * k // 2, "links": 8 * k * k // 2}
    mrft = build_topology(TopologySpec("mrft", k=k, rails=8)) if k * k // 2 >= 8 * k // 2 else None
    if mrft:
        assert _agree(mrft)["links"] == k * k // 2
    if k <= 32:
        ft3 = build_topology(TopologySpec("ft3", k=k))
        assert _agree(ft3) == {"endpoints": k**3 // 4, "switches": 5 * k * k // 4, "links": k**3 // 2}


@pytest.mark.parametrize("kind,n", [("ft2", 256), ("mpft", 2048), ("mrft", 512), ("ft3", 2048), ("ft3", 40)])
def test_partial_fat_trees_count_only_what_they_build(kind, n):
    topo = build_topology(TopologySpec(kind, k=64, endpoints=n))
    assert _agree(topo)["endpoints"] == n


def test_table3_counts_exactly():
    rows = {r["row"]: r for r in table3_rows()}
    expected = {"FT2": (2048, 96, 2048), "MPFT": (16384, 768, 16384), "FT3": (65536, 5120, 131072),
                "SF": (32928, 1568, 32928), "DF": (261632, 16352, 384272)}
    for name, (e, s, l) in expected.items():
        assert (rows[name]["endpoints"], rows[name]["switches"], rows[name]["links"]) == (e, s, l)


def test_table3_buildable_rows_by_graph():
    """The FT2, MPFT and FT3 rows counted on real graphs (SF q=28 cannot be built, DF is slow: below)."""
    assert graph_counts(build_topology(TopologySpec("ft2", k=64)).graph) == {
        "endpoints": 2048, "switches": 96, "links": 2048}
    assert graph_counts(build_topology(TopologySpec("mpft", k=64)).graph) == {
        "endpoints": 16384, "switches": 768, "links": 16384}
    assert graph_counts(build_topology(TopologySpec("ft3", k=64)).graph) == {
        "endpoints": 65536, "switches": 5120, "links": 131072}


def test_table3_dragonfly_row_by_graph():
    topo = build_topology(TopologySpec("df", p=16, a=32, h=16, g=511))
    assert graph_counts(topo.graph) == {"endpoints": 261632, "switches": 16352, "links": 384272}
    assert any("511" in n for n in topo.notes)


def test_slimfly_q28_is_refused_and_q27_builds_at_formula():
    assert prime_power(28) is None
    with pytest.raises(DSV3Error, match="not a prime power"):
        build_topology(TopologySpec("sf", q=28))
    f = slimfly_formula(28)
    assert (f["endpoints"], f["switches"], f["links"], f["radix"]) == (32928, 1568, 32928, 63)


@pytest.mark.parametrize("q", [3, 4, 5, 7, 8, 9, 11, 13])
def test_slimfly_is_regular_with_diameter_two(q):
    topo = build_topology(TopologySpec("sf", q=q))
    _agree(topo)
    sg = switch_graph(topo.graph)
    assert set(dict(sg.degree()).values()) == {slimfly_formula(q)["network_radix"]}
    assert graph_diameter(topo) == 2


@pytest.mark.parametrize("p,a,h,g", [(1, 2, 1, None), (2, 4, 2, None), (2, 4, 2, 7), (2, 4, 2, 8), (3, 6, 3, None)])
def test_dragonfly_counts_and_diameter(p, a, h, g):
    topo = build_topology(TopologySpec("df", p=p, a=a, h=h, g=g))
    counted = _agree(topo)
    groups = g or a * h + 1
    assert counted["switches"] == a * groups
    assert graph_diameter(topo) == 3
    # every router uses exactly a-1 local and h global ports (all global ports are used, as Table 3 counts)
    link_degree = {}
    for u, v, d in topo.graph.edges(data=True):
        if d["kind"] == "link":
            for node in (u, v):
                link_degree[node] = link_degree.get(node, 0) + 1
    assert set(link_degree.values()) == {a - 1 + h}


def test_dragonfly_canonical_bisection_matches_graph():
    d = describe(build_topology(TopologySpec("df", p=2, a=4, h=2)))
    assert d["bisection_links"]["formula"] == d["bisection_links"]["graph"] == 4 * 5


@pytest.mark.parametrize("kind,k", [("ft2", 16), ("ft3", 8), ("mpft", 16), ("mrft", 32)])
def test_fat_tree_diameter_and_bisection(kind, k):
    d = describe(build_topology(TopologySpec(kind, k=k)))
    assert d["counts_agree"]
    assert d["diameter_switch_hops"]["graph"] == d["diameter_switch_hops"]["formula"]
    assert d["bisection_links"]["graph"] == d["bisection_links"]["formula"] == d["endpoints"]["formula"] // 2


def test_mpft_puts_gpu_i_in_plane_i():
    topo = build_topology(TopologySpec("mpft", k=8, planes=8, endpoints=64))
    for e, sw in enumerate(topo.endpoint_switch):
        assert topo.graph.nodes[sw]["plane"] == e % 8


def test_galois_fields_are_fields():
    for q in (4, 8, 9, 25, 27):
        gf = galois_field(q)
        nonzero = range(1, q)
        for a in nonzero:  # every non-zero element has an inverse
            assert any(gf.mul[a, b] == 1 for b in nonzero)
        powers = {gf.power(gf.primitive, e) for e in range(q - 1)}
        assert powers == set(nonzero)


def test_bad_parameters_are_clear_errors():
    with pytest.raises(DSV3Error, match="at most"):
        build_topology(TopologySpec("ft2", k=8, endpoints=64))
    with pytest.raises(DSV3Error, match="radix"):
        build_topology(TopologySpec("ft2", k=7))
    with pytest.raises(DSV3Error, match="groups"):
        build_topology(TopologySpec("df", p=2, a=4, h=2, g=10))
    with pytest.raises(DSV3Error, match="unknown topology"):
        build_topology(TopologySpec("torus"))
