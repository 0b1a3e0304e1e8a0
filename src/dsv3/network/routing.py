"""Path choice between switches: adaptive (split evenly over all shortest paths), ECMP, static.

Adaptive routing is modelled as ideal packet spraying: a flow's rate divides evenly over every
equal-cost (shortest) path, so a link carries the fraction of paths through it, counted on the BFS DAG:
w(x->y) = sigma_u(x) * sigma_v(y) / sigma_u(v). ECMP and static routing walk hop by hop; at each switch
the flow takes one of the equal-cost next hops, chosen by a salted hash of the flow (ECMP) or by the
destination's digits (static, "D-mod-k", which is conflict-free for shifts on a fat tree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.fabric import UNREACHABLE, Fabric

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A good 64-bit mixer (Steele et al.); numpy uint64 arithmetic wraps, as the hash wants."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def unique_pairs(su: np.ndarray, sv: np.ndarray, n_sw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (source switch, destination switch) pairs and each flow's pair index."""
    keys, inverse = np.unique(su * n_sw + sv, return_inverse=True)
    return keys // n_sw, keys % n_sw, inverse


def adaptive_groups(fabric: Fabric, pu: np.ndarray, pv: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-pair link weights for an even split over all shortest paths.

    Returns COO arrays (link, pair, weight) and the hop count of every pair.
    """
    ids, tails, heads = fabric.switch_link_view()
    sources, src_row = np.unique(pu, return_inverse=True)
    targets, dst_row = np.unique(pv, return_inverse=True)
    dist_s, sig_s = fabric.bfs(sources)
    dist_t, sig_t = fabric.bfs(targets)
    hops = dist_s[src_row, pv].astype(np.int64)
    if (hops >= UNREACHABLE).any():
        bad = int(np.flatnonzero(hops >= UNREACHABLE)[0])
        raise DSV3Error(f"no path between switches {fabric.switch_names[pu[bad]]} and "
                        f"{fabric.switch_names[pv[bad]]} after the failures")
    links, groups, weights = [], [], []
    for row in range(len(sources)):
        pairs = np.flatnonzero(src_row == row)
        du, su_ = dist_s[row], sig_s[row]
        dag = du[tails].astype(np.int64) + 1 == du[heads]
        d_tail, d_head = du[tails[dag]], heads[dag]
        need = hops[pairs][:, None]  # [P, 1]
        on = d_tail[None, :] + 1 + dist_t[dst_row[pairs]][:, d_head] == need  # [P, n_dag]
        p_idx, l_idx = np.nonzero(on)
        w = su_[tails[dag][l_idx]] * sig_t[dst_row[pairs[p_idx]], d_head[l_idx]] / su_[pv[pairs[p_idx]]]
        links.append(ids[dag][l_idx])
        groups.append(pairs[p_idx])
        weights.append(w)
    return np.concatenate(links), np.concatenate(groups), np.concatenate(weights), hops


def _out_link_table(fabric: Fabric) -> np.ndarray:
    """[n_switches, max_degree] alive out-links per switch, padded with -1."""
    ids, tails, _ = fabric.switch_link_view()
    n_sw = len(fabric.switch_names)
    order = np.argsort(tails, kind="stable")
    ids, tails = ids[order], tails[order]
    counts = np.bincount(tails, minlength=n_sw)
    table = np.full((n_sw, max(1, counts.max(initial=0))), -1, dtype=np.int64)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    table[tails, np.arange(len(ids)) - starts[tails]] = ids
    return table


Chooser = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def walk_paths(fabric: Fabric, su: np.ndarray, sv: np.ndarray, choose: Chooser, chunk: int = 65_536) -> np.ndarray:
    """Hop-by-hop single-path routing: [F, max_hops] link ids (padded with the dummy link).

    ``choose(step, flow_index, current_switch, n_choices)`` returns which equal-cost next hop to take.
    """
    table = _out_link_table(fabric)
    targets, t_row = np.unique(sv, return_inverse=True)
    dist_t, _ = fabric.bfs(targets)
    hops = dist_t[t_row, su].astype(np.int64)
    if (hops >= UNREACHABLE).any():
        raise DSV3Error("some switch pairs have no path left after the failures")
    width = max(1, int(hops.max(initial=0)))
    out = np.full((len(su), width), fabric.dummy, dtype=np.int64)
    for lo in range(0, len(su), chunk):
        sl = slice(lo, lo + chunk)
        cur, rows = su[sl].copy(), t_row[sl]
        flow_ids = np.arange(lo, lo + len(cur))
        for step in range(width):
            moving = np.flatnonzero(cur != sv[sl])
            if len(moving) == 0:
                break
            c, r = cur[moving], rows[moving]
            cand = table[c]  # [n, deg]
            nxt = np.where(cand >= 0, fabric.dst[np.maximum(cand, 0)], 0)
            ok = (cand >= 0) & (dist_t[r[:, None], nxt] == dist_t[r, c][:, None] - 1)
            count = ok.sum(axis=1)
            pick = choose(step, flow_ids[moving], c, count) % count
            pos = np.argmax(np.cumsum(ok, axis=1) > pick[:, None], axis=1)
            link = cand[np.arange(len(moving)), pos]
            out[lo + moving, step] = link
            cur[moving] = fabric.dst[link]
    return out


def ecmp_chooser(flow_hash: np.ndarray, salt: int) -> Chooser:
    """Each switch hashes the flow with its own salt (as real switches do, avoiding polarisation)."""

    def choose(step: int, flows: np.ndarray, switch: np.ndarray, count: np.ndarray) -> np.ndarray:
        h = splitmix64(flow_hash[flows] ^ splitmix64(switch.astype(np.uint64) + np.uint64(salt)))
        return (h % count.astype(np.uint64)).astype(np.int64)

    return choose


def static_chooser(dest_rank: np.ndarray) -> Chooser:
    """Destination-mod-k: hop i takes digit i of the destination's rank in mixed radix of the fan-outs."""
    radix = np.ones(len(dest_rank), dtype=np.int64)

    def choose(step: int, flows: np.ndarray, switch: np.ndarray, count: np.ndarray) -> np.ndarray:
        digit = (dest_rank[flows] // radix[flows]) % count
        radix[flows] *= count
        return digit

    return choose
