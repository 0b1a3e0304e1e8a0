"""Max-min fairness by progressive filling on hand-checked cases, and the drain event loop."""

import numpy as np
import pytest

from dsv3.network.maxmin import FlowSet, drain, max_min_rates

INF = np.inf


def _flows(paths, nbytes, n_links, groups=None, coo=None):
    width = max(len(p) for p in paths)
    dummy = n_links  # the last link is the dummy
    direct = np.full((len(paths), width), dummy)
    for i, p in enumerate(paths):
        direct[i, : len(p)] = p
    group = np.full(len(paths), -1) if groups is None else np.array(groups)
    g_link, g_group, g_weight = (np.zeros(0, int), np.zeros(0, int), np.zeros(0)) if coo is None else coo
    return FlowSet(direct, group, np.array(g_link), np.array(g_group), np.array(g_weight, float),
                   np.array(nbytes, float), n_links + 1)


def test_textbook_three_flows_two_links():
    # link 0 (cap 1) carries flows A and B; link 1 (cap 2) carries B and C: A = B = 0.5, C = 1.5
    fs = _flows([[0], [0, 1], [1]], [1, 1, 1], 2)
    rates, _ = max_min_rates(fs, np.array([1.0, 2.0, INF]))
    assert rates == pytest.approx([0.5, 0.5, 1.5])


def test_bertsekas_gallager_example():
    # 4 links of capacity 1; flow 0 crosses links 0,1,2; flows 1,2,3 each cross one of them; flow 4 link 3 only
    fs = _flows([[0, 1, 2], [0], [1], [2], [3]], [1] * 5, 4)
    rates, _ = max_min_rates(fs, np.array([1.0, 1.0, 1.0, 1.0, INF]))
    assert rates == pytest.approx([0.5, 0.5, 0.5, 0.5, 1.0])


def test_unequal_capacities_cascade():
    # link 0 cap 3 shared by 3 flows; flow 0 also crosses link 1 of cap 0.5
    fs = _flows([[0, 1], [0], [0]], [1, 1, 1], 2)
    rates, iterations = max_min_rates(fs, np.array([3.0, 0.5, INF]))
    assert rates == pytest.approx([0.5, 1.25, 1.25])
    assert iterations == 2


def test_split_flow_over_two_paths():
    # flow 0 splits evenly over links 0 and 1 (group 0); flow 1 uses link 1 alone; both cap 1.
    # flow 0 loads each link with r0/2: fair share r0 = r1 = 2/3 on link 1 (r0/2 + r1 = 1)
    fs = _flows([[], [1]], [1, 1], 2, groups=[0, -1], coo=([0, 1], [0, 0], [0.5, 0.5]))
    rates, _ = max_min_rates(fs, np.array([1.0, 1.0, INF]))
    assert rates == pytest.approx([2 / 3, 2 / 3])


def test_rates_are_feasible_and_each_flow_has_a_bottleneck():
    rng = np.random.default_rng(0)
    n_links, n_flows = 12, 40
    paths = [list(rng.choice(n_links, size=rng.integers(1, 4), replace=False)) for _ in range(n_flows)]
    cap = np.r_[rng.uniform(1, 5, n_links), INF]
    fs = _flows(paths, np.ones(n_flows), n_links)
    rates, _ = max_min_rates(fs, cap)
    load = fs.link_load(rates)
    assert (load[:n_links] <= cap[:n_links] * (1 + 1e-9)).all()
    # max-min: every flow crosses a full link on which no other flow gets more than it does
    for f, p in enumerate(paths):
        bottlenecks = [l for l in p if load[l] >= cap[l] * (1 - 1e-9)]
        assert any(all(rates[g] <= rates[f] + 1e-9 for g in range(n_flows) if l in paths[g]) for l in bottlenecks)


def test_drain_reallocates_after_a_flow_finishes():
    # two flows share a link of capacity 1: the short one (1 byte) ends at t=2, the long (3 bytes) at t=4
    fs = _flows([[0], [0]], [1, 3], 1)
    result = drain(fs, np.array([1.0, INF]))
    assert result.finish == pytest.approx([2.0, 4.0])
    assert result.events == 2


def test_drain_tolerance_batches_near_simultaneous_finishes():
    fs = _flows([[0], [1], [2]], [1.0, 1.0005, 2.0], 3)
    exact = drain(fs, np.array([1.0, 1.0, 1.0, INF]))
    loose = drain(fs, np.array([1.0, 1.0, 1.0, INF]), rtol=1e-3)
    assert exact.events == 3 and loose.events == 2
    assert loose.finish.max() == pytest.approx(exact.finish.max())
