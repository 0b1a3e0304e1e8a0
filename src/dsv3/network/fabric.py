"""The simulator's view of a topology: directed links with capacities, NICs, NVLink, and failures.

Link ids: switch-to-switch links come first as pairs (2i = u->v, 2i+1 = v->u), then per endpoint its NIC
uplink, NIC downlink, NVLink out (GPU -> NVSwitch) and NVLink in. One extra "dummy" link with infinite
capacity pads the per-flow link lists. Failing a link removes both directions, as a cut cable does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.topology import Topology

NVLINK, NIC_UP, NIC_DOWN, SWITCH = 0, 1, 2, 3
LINK_KIND_NAMES = {NVLINK: "nvlink", NIC_UP: "nic_up", NIC_DOWN: "nic_down", SWITCH: "switch"}
UNREACHABLE = np.iinfo(np.int16).max


@dataclass(frozen=True)
class LinkSpeeds:
    """Per-direction bandwidths. Defaults: 400 Gb/s IB NICs and switch ports, H800 NVLink at 160 GB/s."""

    nic_gbps: float = 400.0
    switch_gbps: float | None = None  # None: same as the NIC
    nvlink_GBps: float = 160.0

    def bytes_per_s(self) -> tuple[float, float, float]:
        nic = self.nic_gbps * 1e9 / 8
        sw = (self.switch_gbps if self.switch_gbps is not None else self.nic_gbps) * 1e9 / 8
        return nic, sw, self.nvlink_GBps * 1e9


class Fabric:
    """Directed link arrays for one topology plus the per-endpoint NIC and NVLink link ids."""

    def __init__(self, topo: Topology, speeds: LinkSpeeds = LinkSpeeds()):
        nic_bw, sw_bw, nvl_bw = speeds.bytes_per_s()
        if min(nic_bw, sw_bw, nvl_bw) <= 0:
            raise DSV3Error("link bandwidths must be positive")
        self.topo = topo
        g = topo.graph
        self.switch_names = [n for n, d in g.nodes(data=True) if d["kind"] == "switch"]
        self.switch_index = {n: i for i, n in enumerate(self.switch_names)}
        self.switch_plane = np.array([g.nodes[n]["plane"] for n in self.switch_names])
        pairs = [(self.switch_index[u], self.switch_index[v]) for u, v, d in g.edges(data=True) if d["kind"] == "link"]
        sw = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        n_sw_links = 2 * len(sw)
        E = topo.n_endpoints
        self.n_links = n_sw_links + 4 * E
        self.src = np.full(self.n_links, -1, dtype=np.int64)  # switch index at the tail, -1 for non-switch
        self.dst = np.full(self.n_links, -1, dtype=np.int64)
        self.src[0:n_sw_links:2], self.dst[0:n_sw_links:2] = sw[:, 0], sw[:, 1]
        self.src[1:n_sw_links:2], self.dst[1:n_sw_links:2] = sw[:, 1], sw[:, 0]
        base = n_sw_links + 4 * np.arange(E)
        self.nic_up, self.nic_down, self.nvl_out, self.nvl_in = base, base + 1, base + 2, base + 3
        self.ep_switch = np.array([self.switch_index[s] for s in topo.endpoint_switch], dtype=np.int64)
        self.dst[self.nic_up] = self.ep_switch
        self.src[self.nic_down] = self.ep_switch
        self.kind = np.empty(self.n_links + 1, dtype=np.int8)
        self.kind[:n_sw_links] = SWITCH
        self.kind[self.nic_up], self.kind[self.nic_down] = NIC_UP, NIC_DOWN
        self.kind[self.nvl_out], self.kind[self.nvl_in] = NVLINK, NVLINK
        self.kind[-1] = -1
        self.capacity = np.empty(self.n_links + 1)
        self.capacity[:n_sw_links] = sw_bw
        self.capacity[self.nic_up] = self.capacity[self.nic_down] = nic_bw
        self.capacity[self.nvl_out] = self.capacity[self.nvl_in] = nvl_bw
        self.capacity[-1] = np.inf
        self.alive = np.ones(self.n_links + 1, dtype=bool)
        self.n_switch_links = n_sw_links
        self.ep_rank = self._endpoint_ranks()

    @property
    def dummy(self) -> int:
        """The padding link: infinite capacity, never a bottleneck, left out of every statistic."""
        return self.n_links

    @property
    def gpus_per_node(self) -> int:
        return self.topo.gpus_per_node

    def _endpoint_ranks(self) -> np.ndarray:
        """Destination digits for static routing: port on its switch + ports x (switch's order in its plane).

        Taken digit by digit against each hop's fan-out this is "D-mod-k": the first hop picks by the
        destination's port, so the last hop down to a leaf is never shared by two destinations.
        """
        E = self.topo.n_endpoints
        order = np.argsort(self.ep_switch, kind="stable")
        sw_sorted = self.ep_switch[order]
        starts = np.r_[0, np.flatnonzero(sw_sorted[1:] != sw_sorted[:-1]) + 1]
        port = np.empty(E, dtype=np.int64)
        port[order] = np.arange(E) - np.repeat(starts, np.diff(np.r_[starts, E]))
        ports = int(port.max(initial=0)) + 1
        plane = self.switch_plane[self.ep_switch]
        rank = np.empty(E, dtype=np.int64)
        for p in np.unique(plane):
            members = np.flatnonzero(plane == p)
            _, switch_order = np.unique(self.ep_switch[members], return_inverse=True)
            rank[members] = port[members] + ports * switch_order
        return rank

    # ----------------------------------------------------------------------------------------- failures
    def fail_switch_links(self, undirected_ids: np.ndarray) -> None:
        """Cut switch-to-switch links given as undirected indices (0 .. n_switch_links/2 - 1)."""
        ids = np.asarray(undirected_ids, dtype=np.int64)
        self.alive[2 * ids] = False
        self.alive[2 * ids + 1] = False

    def fail_switches(self, switches: np.ndarray) -> None:
        """A dead switch takes its switch links and the NIC links plugged into it."""
        dead = np.zeros(len(self.switch_names), dtype=bool)
        dead[np.asarray(switches, dtype=np.int64)] = True
        sw_part = slice(0, self.n_switch_links)
        self.alive[sw_part] &= ~(dead[self.src[sw_part]] | dead[self.dst[sw_part]])
        hit = dead[self.ep_switch]
        self.alive[self.nic_up[hit]] = False
        self.alive[self.nic_down[hit]] = False

    def fail_random_links(self, n: int, rng: np.random.Generator) -> np.ndarray:
        alive_ids = np.flatnonzero(self.alive[0:self.n_switch_links:2])
        if n > len(alive_ids):
            raise DSV3Error(f"cannot fail {n} links: the fabric has {len(alive_ids)} switch-to-switch links")
        chosen = rng.choice(alive_ids, size=n, replace=False)
        self.fail_switch_links(chosen)
        return chosen

    def fail_random_switches(self, n: int, rng: np.random.Generator) -> list:
        if n > len(self.switch_names):
            raise DSV3Error(f"cannot fail {n} switches: the fabric has {len(self.switch_names)}")
        chosen = rng.choice(len(self.switch_names), size=n, replace=False)
        self.fail_switches(chosen)
        return [self.switch_names[i] for i in chosen]

    def fail_plane(self, plane: int) -> None:
        """MPFT: every switch of plane ``plane``. MRFT: the leaves of rail ``plane`` (spines are shared)."""
        topo = self.topo
        if topo.planes > 1:
            if not 0 <= plane < topo.planes:
                raise DSV3Error(f"--fail-plane must be in 0..{topo.planes - 1}")
            self.fail_switches(np.flatnonzero(self.switch_plane == plane))
        elif topo.kind == "mrft":
            rails = topo.params["rails"]
            if not 0 <= plane < rails:
                raise DSV3Error(f"--fail-plane must be in 0..{rails - 1} (the rails of this MRFT)")
            rail_eps = np.flatnonzero(np.arange(topo.n_endpoints) % topo.gpus_per_node % rails == plane)
            self.fail_switches(np.unique(self.ep_switch[rail_eps]))
        else:
            raise DSV3Error("--fail-plane needs a multi-plane (mpft) or multi-rail (mrft) topology")

    def nic_alive(self) -> np.ndarray:
        return self.alive[self.nic_up] & self.alive[self.nic_down]

    # ----------------------------------------------------------------------------------------- paths
    def switch_link_view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, tails, heads) of the alive directed switch-to-switch links."""
        ids = np.flatnonzero(self.alive[: self.n_switch_links])
        return ids, self.src[ids], self.dst[ids]

    def bfs(self, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hop distances and shortest-path counts from each source switch to every switch.

        Level-synchronous BFS over a block of sources at once: dist, sigma: [n_sources, n_switches].
        """
        sources = np.asarray(sources, dtype=np.int64)
        n_sw = len(self.switch_names)
        dist = np.full((len(sources), n_sw), UNREACHABLE, dtype=np.int16)
        sigma = np.zeros((len(sources), n_sw))
        _, tails, heads = self.switch_link_view()
        block = max(1, 2_000_000 // max(1, len(heads)))
        for lo in range(0, len(sources), block):
            d, s = _bfs_block(sources[lo : lo + block], n_sw, tails, heads)
            dist[lo : lo + block], sigma[lo : lo + block] = d, s
        return dist, sigma


def _bfs_block(sources: np.ndarray, n_sw: int, tails: np.ndarray, heads: np.ndarray):
    """One block of the multi-source BFS (see Fabric.bfs)."""
    rows = np.arange(len(sources))
    dist = np.full((len(sources), n_sw), UNREACHABLE, dtype=np.int16)
    sigma = np.zeros((len(sources), n_sw))
    dist[rows, sources] = 0
    sigma[rows, sources] = 1.0
    if len(heads) == 0:
        return dist, sigma
    order = np.argsort(heads, kind="stable")
    tails, heads = tails[order], heads[order]
    starts = np.flatnonzero(np.r_[True, heads[1:] != heads[:-1]])
    targets = heads[starts]
    level = 0
    while True:
        on_front = dist[:, tails] == level  # [n_src, n_links]
        if not on_front.any():
            return dist, sigma
        reach = np.add.reduceat(np.where(on_front, sigma[:, tails], 0.0), starts, axis=1)  # [n_src, n_targets]
        sub_dist, sub_sigma = dist[:, targets], sigma[:, targets]
        fresh = (reach > 0) & (sub_dist == UNREACHABLE)
        sub_dist[fresh] = level + 1
        sub_sigma[fresh] = reach[fresh]
        dist[:, targets], sigma[:, targets] = sub_dist, sub_sigma
        level += 1
