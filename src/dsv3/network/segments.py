"""Turn GPU-to-GPU transfers into NVLink segments and NIC-to-NIC network segments.

Cross-plane traffic in a multi-plane fabric cannot stay in the network: it is forwarded over NVLink to
the GPU whose NIC sits in the right plane, on the source side (NCCL's PXN, the default) or on the
destination side (DeepEP's dispatch). A forwarded transfer becomes two segments that run as a pipeline
(chunked, as PXN and DeepEP do), so its time is that of its slower segment. Segments with the same
endpoints are merged, which is what makes an all-to-all over thousands of GPUs tractable: the network
sees one NIC-to-NIC flow per node pair and plane, exactly what a relaying NIC sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.network.fabric import Fabric


@dataclass
class Segments:
    """Merged segments: NVLink (x -> y) and network (NIC r -> NIC q), bytes per segment."""

    nvl_src: np.ndarray
    nvl_dst: np.ndarray
    nvl_bytes: np.ndarray
    net_src: np.ndarray
    net_dst: np.ndarray
    net_bytes: np.ndarray
    stats: dict = field(default_factory=dict)


def _merge(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Sum bytes per (src, dst) pair; returns pairs sorted by src * n + dst.

    When the keys span a range not much larger than their count (a chunk of sources, as traffic
    generators yield them) a dense bincount replaces the sort, which is what dominates large runs.
    """
    if len(src) == 0:
        return src, dst, nbytes
    keys = src * n + dst
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo < 4 * len(keys) + 1_000_000:
        sums = np.bincount(keys - lo, weights=nbytes, minlength=hi - lo + 1)
        present = np.bincount(keys - lo, minlength=hi - lo + 1) > 0
        uniq = np.flatnonzero(present) + lo
        return uniq // n, uniq % n, sums[present]
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq // n, uniq % n, np.bincount(inverse, weights=nbytes)


def _concat_merge(parts: list, n: int) -> tuple[np.ndarray, ...]:
    """Merge per-chunk results; chunks with increasing, disjoint keys are already merged."""
    a, b, w = (np.concatenate([p[i] for p in parts]) for i in range(3))
    keys = a * n + b
    if len(keys) < 2 or (np.diff(keys) > 0).all():
        return a, b, w
    return _merge(a, b, w, n)


class SegmentBuilder:
    """Accumulates transfers chunk by chunk (bounded memory) and merges them at the end."""

    def __init__(self, fabric: Fabric, relay: str = "source", pxn: bool = False):
        if relay not in ("source", "dest"):
            raise DSV3Error(f"--relay must be 'source' or 'dest', got {relay!r}")
        topo = fabric.topo
        self.fabric, self.relay = fabric, relay
        self.G = topo.gpus_per_node
        self.E = topo.n_endpoints
        # planes that force alignment: MPFT always; MRFT rails when PXN is asked for
        self.slots = topo.planes if topo.planes > 1 else (topo.params["rails"] if pxn and topo.kind == "mrft" else 0)
        nodes = -(-self.E // self.G)
        alive = np.zeros(nodes * self.G, dtype=bool)
        alive[: self.E] = fabric.nic_alive()
        self.slot_alive = alive.reshape(nodes, self.G)
        self.parts: dict[str, list] = {"nvl": [], "net": []}
        self.stats = {"transfers": 0, "bytes": 0.0, "internode_bytes": 0.0, "forwarded_nvlink_bytes": 0.0,
                      "relayed_transfers": 0, "max_nvlink_hops": 0}

    def add(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Add transfers (GPU indices, bytes); self-transfers and empty ones are dropped."""
        keep = (src != dst) & (nbytes > 0)
        src, dst, nbytes = src[keep].astype(np.int64), dst[keep].astype(np.int64), nbytes[keep].astype(float)
        if len(src) == 0:
            return
        if src.max() >= self.E or dst.max() >= self.E or min(src.min(), dst.min()) < 0:
            raise DSV3Error(f"traffic names a GPU outside 0..{self.E - 1}")
        G = self.G
        self.stats["transfers"] += len(src)
        self.stats["bytes"] += float(nbytes.sum())
        intra = src // G == dst // G
        self._push("nvl", src[intra], dst[intra], nbytes[intra])
        s, d, b = src[~intra], dst[~intra], nbytes[~intra]
        self.stats["internode_bytes"] += float(b.sum())
        idx, r, q, frac = self._choose_nics(s, d)
        s, d, b = s[idx], d[idx], b[idx] * frac
        pre, post = r != s, q != d
        self._push("nvl", s[pre], r[pre], b[pre])
        self._push("nvl", q[post], d[post], b[post])
        self._push("net", r, q, b)
        self.stats["forwarded_nvlink_bytes"] += float(b[pre].sum() + b[post].sum())
        relayed = np.zeros(len(idx) and int(idx.max()) + 1, dtype=bool)
        relayed[idx[pre | post]] = True
        self.stats["relayed_transfers"] += int(relayed.sum())
        hops = pre.astype(int) + post.astype(int)
        self.stats["max_nvlink_hops"] = max(self.stats["max_nvlink_hops"], int(hops.max(initial=0)))

    def _push(self, kind: str, a: np.ndarray, b: np.ndarray, nbytes: np.ndarray) -> None:
        if len(a):
            self.parts[kind].append(_merge(a, b, nbytes, self.E))

    def _choose_nics(self, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, ...]:
        """NICs for inter-node transfers, honouring planes and dead NICs.

        Returns (transfer index, source NIC, destination NIC, share of the bytes): a transfer whose
        preferred NIC is dead is split evenly over every NIC (pair) still alive on its nodes, as a bonded
        multi-port NIC or NCCL's channels over the surviving NICs would spread it.
        """
        G, R = self.G, self.slots
        ns, nd, ls, ld = s // G, d // G, s % G, d % G
        idx = np.arange(len(s))
        if R:
            j = ld % R if self.relay == "source" else ls % R
            r = ns * G + (ls // R) * R + j
            q = nd * G + (ld // R) * R + j
            ok = self.slot_alive[ns, r % G] & self.slot_alive[nd, q % G]
            frac = np.ones(len(s))
            if ok.all():
                return idx, r, q, frac
            bad = np.flatnonzero(~ok)  # any local index alive on both nodes (same index = same plane)
            rows, c, share = self._spread(self.slot_alive[ns[bad]] & self.slot_alive[nd[bad]], s, d, bad)
            b_idx = bad[rows]
            return (np.r_[idx[ok], b_idx], np.r_[r[ok], ns[b_idx] * G + c], np.r_[q[ok], nd[b_idx] * G + c],
                    np.r_[frac[ok], share])
        r_ok, q_ok = self.slot_alive[ns, ls], self.slot_alive[nd, ld]
        ok = r_ok & q_ok
        if ok.all():
            return idx, s.copy(), d.copy(), np.ones(len(s))
        bad = np.flatnonzero(~ok)
        own = np.arange(G)[None, :]
        src_c = np.where(r_ok[bad, None], own == ls[bad, None], self.slot_alive[ns[bad]])  # [n_bad, G]
        dst_c = np.where(q_ok[bad, None], own == ld[bad, None], self.slot_alive[nd[bad]])
        rows, cs, cd, share = self._pair_spread(src_c, dst_c, s, d, bad)
        b_idx = bad[rows]
        return (np.r_[idx[ok], b_idx], np.r_[s[ok], ns[b_idx] * G + cs], np.r_[d[ok], nd[b_idx] * G + cd],
                np.r_[np.ones(int(ok.sum())), share])

    def _pair_spread(self, src_c: np.ndarray, dst_c: np.ndarray, s, d, bad):
        """Every (source NIC, destination NIC) pair alive for each row, each with an equal share."""
        n_src, n_dst = src_c.sum(axis=1), dst_c.sum(axis=1)
        self._check(np.minimum(n_src, n_dst), s, d, bad)
        rows_s, cols_s = np.nonzero(src_c)
        rows_d, cols_d = np.nonzero(dst_c)
        ptr_d = np.r_[0, np.cumsum(n_dst)]
        rep = np.repeat(np.arange(len(rows_s)), n_dst[rows_s])  # one entry per (source col, dest col)
        start = np.repeat(ptr_d[rows_s], n_dst[rows_s])
        within = np.arange(len(rep)) - np.repeat(np.r_[0, np.cumsum(n_dst[rows_s])[:-1]], n_dst[rows_s])
        rows = rows_s[rep]
        return rows, cols_s[rep], cols_d[start + within], 1.0 / (n_src[rows] * n_dst[rows])

    def _spread(self, candidates: np.ndarray, s, d, bad) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every True (row, column) of ``candidates`` [n, G] with share 1 / (Trues in its row)."""
        count = candidates.sum(axis=1)
        self._check(count, s, d, bad)
        rows, cols = np.nonzero(candidates)
        return rows, cols, 1.0 / count[rows]

    @staticmethod
    def _check(count: np.ndarray, s, d, bad) -> None:
        if (count == 0).any():
            i = bad[int(np.flatnonzero(count == 0)[0])]
            raise DSV3Error(f"GPU {int(s[i])} cannot reach GPU {int(d[i])}: no working NIC pair after the failures")

    def build(self) -> Segments:
        out = []
        for kind in ("nvl", "net"):
            parts = self.parts[kind]
            if parts:
                out.append(_concat_merge(parts, self.E))
            else:
                empty = np.zeros(0, dtype=np.int64)
                out.append((empty, empty, np.zeros(0)))
        return Segments(*out[0], *out[1], stats=dict(self.stats))
