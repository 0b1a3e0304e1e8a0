"""Max-min fair rates by progressive filling, and the event loop that drains flows to completion.

A flow's rate r_f loads link l with A[l, f] * r_f. A is stored factored so an all-to-all stays small:
``direct`` [F, W] lists links a flow uses whole (NIC, NVLink, its ECMP/static path; padded with a dummy
link of infinite capacity), and ``group`` names a shared weight column (an adaptive split over the
equal-cost paths of a switch pair) held once as COO arrays. Everything is numpy; no per-flow Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class FlowSet:
    """Flows and the factored link incidence; n_links includes the dummy padding link."""

    direct: np.ndarray  # [F, W] int64 link ids
    group: np.ndarray  # [F] int64 column of the shared weights, -1 for none
    g_link: np.ndarray  # COO of the shared weights: link, group, weight
    g_group: np.ndarray
    g_weight: np.ndarray
    nbytes: np.ndarray  # [F]
    n_links: int

    @property
    def n_flows(self) -> int:
        return len(self.nbytes)

    @property
    def n_groups(self) -> int:
        return int(self.g_group.max(initial=-1)) + 1

    def link_load(self, per_flow: np.ndarray) -> np.ndarray:
        """A @ per_flow: what each link carries when flow f sends per_flow[f] (a rate or bytes)."""
        W = self.direct.shape[1]
        load = np.bincount(self.direct.ravel(), weights=np.repeat(per_flow, W), minlength=self.n_links)
        if len(self.g_link):
            has = self.group >= 0
            per_group = np.bincount(self.group[has], weights=per_flow[has], minlength=self.n_groups)
            load += np.bincount(self.g_link, weights=self.g_weight * per_group[self.g_group], minlength=self.n_links)
        return load


class _Inverse:
    """Link -> flows and link -> groups -> flows lookups (CSR), built once per drain."""

    def __init__(self, flows: FlowSet):
        F, W = flows.direct.shape
        L = flows.n_links
        flat = flows.direct.ravel()
        order = np.argsort(flat, kind="stable")
        self.link_ptr = np.r_[0, np.cumsum(np.bincount(flat, minlength=L))]
        self.link_flows = (order // W).astype(np.int64)
        G = flows.n_groups
        gorder = np.argsort(flows.group, kind="stable")
        gorder = gorder[flows.group[gorder] >= 0]
        self.group_ptr = np.r_[0, np.cumsum(np.bincount(flows.group[gorder], minlength=G))] if G else np.zeros(1, int)
        self.group_flows = gorder
        self.n_groups = G

    def flows_on(self, links: np.ndarray, flows: FlowSet) -> np.ndarray:
        """Every flow that crosses one of ``links`` (directly or through its group's weights)."""
        parts = [_ranges(self.link_ptr, self.link_flows, links)]
        if self.n_groups:
            hit = np.zeros(flows.n_links, dtype=bool)
            hit[links] = True
            groups = np.unique(flows.g_group[hit[flows.g_link]])
            parts.append(_ranges(self.group_ptr, self.group_flows, groups))
        return np.concatenate(parts)


def _ranges(ptr: np.ndarray, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Concatenate values[ptr[k]:ptr[k+1]] for every k in keys, without a Python loop."""
    if len(keys) == 0:
        return values[:0]
    lo, hi = ptr[keys], ptr[keys + 1]
    lengths = hi - lo
    total = int(lengths.sum())
    if total == 0:
        return values[:0]
    offsets = np.repeat(lo - np.r_[0, np.cumsum(lengths)[:-1]], lengths)
    return values[np.arange(total) + offsets]


def _group_load(flows: FlowSet, per_flow: np.ndarray) -> np.ndarray:
    has = flows.group >= 0
    per_group = np.bincount(flows.group[has], weights=per_flow[has], minlength=flows.n_groups)
    return np.bincount(flows.g_link, weights=flows.g_weight * per_group[flows.g_group], minlength=flows.n_links)


def max_min_rates(flows: FlowSet, capacity: np.ndarray, active: np.ndarray | None = None,
                  inverse: _Inverse | None = None, fill_rtol: float = 0.0) -> tuple[np.ndarray, int]:
    """Progressive filling: raise all unfrozen rates together; freeze the flows crossing a full link.

    Loads are updated incrementally as flows freeze, so an iteration costs the links plus the flows it
    freezes, not all flows. With ``fill_rtol`` = 0 the result is exact max-min fairness for the given
    split; a positive value also freezes links whose fair share is within that fraction of the smallest
    (rates stay feasible and are at most that fraction below fair; far fewer iterations under ECMP).
    Returns (rates [F], iterations).
    """
    inverse = inverse or _Inverse(flows)
    active = np.ones(flows.n_flows, dtype=bool) if active is None else active.copy()
    n_active = int(active.sum())
    rate = np.zeros(flows.n_flows)
    slot = np.zeros(flows.n_flows, dtype=np.int64)  # scratch for O(n) de-duplication
    load = flows.link_load(active.astype(float))
    residual = capacity.astype(float).copy()
    finite_cap = np.where(np.isfinite(capacity), capacity, 1.0)
    level, iterations = 0.0, 0
    while n_active:
        iterations += 1
        used = load > 1e-9
        share = np.full(len(load), np.inf)
        share[used] = residual[used] / load[used]
        step = share.min()
        if not np.isfinite(step):  # the remaining flows ride only the dummy link
            rate[active] = np.inf
            break
        close = share <= step + fill_rtol * (level + step)  # final rate within fill_rtol of this level
        level += step
        residual[used] -= step * load[used]
        full = used & ((residual <= 1e-9 * finite_cap) | close)
        full[np.argmin(share)] = True
        residual[full] = 0.0
        crossing = inverse.flows_on(np.flatnonzero(full), flows)
        newly = crossing[active[crossing]]
        slot[newly] = np.arange(len(newly))
        newly = newly[slot[newly] == np.arange(len(newly))]  # each flow once
        rate[newly] = level
        active[newly] = False
        n_active -= len(newly)
        load -= np.bincount(flows.direct[newly].ravel(), minlength=flows.n_links)
        if inverse.n_groups and len(newly):
            mask = np.zeros(flows.n_flows)
            mask[newly] = 1.0
            load -= _group_load(flows, mask)
        load[full] = 0.0
    return rate, iterations


@dataclass
class DrainResult:
    finish: np.ndarray  # [F] seconds at which each flow delivered its last byte
    events: int
    iterations: int


def drain(flows: FlowSet, capacity: np.ndarray, rtol: float = 0.0,
          progress: Callable[[float], None] | None = None) -> DrainResult:
    """Fluid simulation: recompute max-min rates at every completion until all bytes are delivered.

    ``rtol`` trades exactness for speed when thousands of flows finish at distinct times (ECMP over
    thousands of GPUs): flows due within ``rtol`` x the elapsed time finish together, and progressive
    filling freezes links within ``rtol`` of the bottleneck share. Times are then early or rates low by
    at most about that fraction. 0 is exact.
    """
    finish = np.zeros(flows.n_flows)
    remaining = flows.nbytes.astype(float).copy()
    active = remaining > 0
    inverse = _Inverse(flows)
    total = float(remaining.sum()) or 1.0
    t, events, iterations = 0.0, 0, 0
    while active.any():
        rate, it = max_min_rates(flows, capacity, active, inverse, fill_rtol=rtol)
        iterations += it
        events += 1
        idx = np.flatnonzero(active)
        left = remaining[idx]
        with np.errstate(divide="ignore"):
            ttf = np.where(rate[idx] > 0, left / rate[idx], np.inf)
        dt = float(ttf.min())
        if not np.isfinite(dt):
            raise RuntimeError("flows with zero rate: the fabric cannot carry them")
        done = ttf <= dt + rtol * (t + dt) + 1e-12 * dt
        t += dt
        finish[idx[done]] = t
        remaining[idx] = np.where(done, 0.0, left - rate[idx] * dt)
        active[idx[done]] = False
        if progress:
            progress(1.0 - float(remaining.sum()) / total)
    return DrainResult(finish=finish, events=events, iterations=iterations)
