"""The deduplicated two-hop all-to-all (V3 §3.2.2, DeepEP's internode kernels) on torch.distributed.

Dispatch is a broadcast down a two-level tree: a token goes over the inter-node hop once per destination
node, to the rank with its own local index there (the forwarder), which sends it over the intra-node hop
once per rank holding some of its experts. Combine is the matching reduction up the tree: each expert rank
sums its experts' weighted outputs per row, the forwarder sums the rows of its node, and one copy per node
goes back over the inter-node hop, where the source sums its nodes.

Every step is a generator that yields while its all-to-all (``async_op=True``) is in flight, so a driver
can run another micro-batch's compute meanwhile; ``run`` (dsv3.model.dispatch) drives one to completion.
Collectives are issued in the same order on every rank because the number and order of steps never
depend on the data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv3.parallel.ep_groups import EPGroups
from dsv3.parallel.wire import WireFormat, from_raw, pack_fields, raw_bytes


@dataclass
class TrafficMeter:
    """Bytes actually handed to all-to-all for other ranks (self-chunks are local copies, not traffic),
    by (phase, level, kind): phase forward/backward, level inter/intra, kind dispatch/combine/gate/slots."""

    bytes: dict = field(default_factory=lambda: defaultdict(int))
    rows: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, key: tuple[str, str, str], rows: int, width: int) -> None:
        self.rows[key] += rows
        self.bytes[key] += rows * width

    def total(self, phase: str, level: str, kinds: tuple[str, ...]) -> int:
        return sum(self.bytes[(phase, level, k)] for k in kinds)

    def reset(self) -> None:
        self.bytes.clear()
        self.rows.clear()


@dataclass
class Hop:
    """One all-to-all over a sub-group with fixed row counts per peer (``send[i]`` rows to peer i)."""

    group: dist.ProcessGroup
    level: str  # "inter" or "intra"
    me: int  # my index in the group
    send: list[int]
    recv: list[int]

    def start(
        self,
        buf: torch.Tensor,
        fields: list[tuple[str, int]],
        reverse: bool = False,
        meter: TrafficMeter | None = None,
        phase: str = "forward",
    ):
        """Launch the all-to-all of rows ``buf [sum send, B]``; ``reverse`` sends back along the same rows.
        ``fields`` names the byte columns for the meter. Returns (output [sum recv, B], work)."""
        send, recv = (self.recv, self.send) if reverse else (self.send, self.recv)
        out = buf.new_empty(sum(recv), buf.shape[1])
        work = dist.all_to_all_single(out, buf.contiguous(), recv, send, group=self.group, async_op=True)
        if meter is not None:
            remote = sum(send) - send[self.me]
            for kind, width in fields:
                meter.add((phase, self.level, kind), remote, width)
        return out, work


def _exchange_counts(send: list[int], group: dist.ProcessGroup, device: torch.device):
    """Generator: tell every peer how many rows it will get from me; returns what each peer sends me."""
    out = torch.empty(len(send), dtype=torch.int64, device=device)
    mine = torch.tensor(send, dtype=torch.int64, device=device)
    work = dist.all_to_all_single(out, mine, group=group, async_op=True)
    yield
    work.wait()
    return out.tolist()


@dataclass
class TwoHopPlan:
    """Everything both hops need, fixed by the routing decisions of one batch of tokens."""

    n_tokens: int
    top_k: int
    h1_token: torch.Tensor  # long [R1]: source token of each inter-node send row (rows ordered by node)
    h1: Hop
    h2_row: torch.Tensor  # long [R2]: received inter-node row of each intra-node send row (by local rank)
    h2: Hop
    expert_slots: torch.Tensor  # long [R2r, K]: my local slot for each received row and choice, -1 if none
    meter: TrafficMeter | None = None


def handshake(slots: torch.Tensor, groups: EPGroups, slots_per_rank: int, meter: TrafficMeter | None = None):
    """Generator building the plan: token counts first, then each row's expert slots, hop by hop.

    slots: long [N, K], the physical expert slot of each token's k-th choice. Returns a TwoHopPlan.
    """
    layout, S = groups.layout, slots_per_rank
    n_tokens, top_k = slots.shape
    dst_rank = slots // S
    dst_node = dst_rank // layout.gpus_per_node
    node_hit = torch.zeros(n_tokens, layout.nodes, dtype=torch.bool, device=slots.device).scatter_(
        1, dst_node, True
    )
    node, h1_token = node_hit.t().nonzero(as_tuple=True)  # rows ordered by destination node
    row_slots = slots[h1_token].masked_fill(dst_node[h1_token] != node.unsqueeze(1), -1)
    send1 = node_hit.sum(0).tolist()
    recv1 = yield from _exchange_counts(send1, groups.inter, slots.device)
    h1 = Hop(groups.inter, "inter", groups.node, send1, recv1)
    fwd_slots = yield from _send_slots(h1, row_slots, meter)  # [R1r, K] at the forwarder

    G = layout.gpus_per_node
    valid = fwd_slots >= 0
    local = torch.where(valid, (fwd_slots.clamp(min=0) // S) % G, G)  # G = "nowhere"
    rank_hit = torch.zeros(fwd_slots.shape[0], G + 1, dtype=torch.bool, device=slots.device)
    rank_hit = rank_hit.scatter_(1, local, True)[:, :G]
    dest, h2_row = rank_hit.t().nonzero(as_tuple=True)  # rows ordered by destination local rank
    mine = valid[h2_row] & (local[h2_row] == dest.unsqueeze(1))
    row2_slots = torch.where(mine, fwd_slots[h2_row] % S, -1)
    send2 = rank_hit.sum(0).tolist()
    recv2 = yield from _exchange_counts(send2, groups.intra, slots.device)
    h2 = Hop(groups.intra, "intra", groups.local, send2, recv2)
    expert_slots = yield from _send_slots(h2, row2_slots, meter)
    return TwoHopPlan(n_tokens, top_k, h1_token, h1, h2_row, h2, expert_slots, meter)


def _send_slots(hop: Hop, row_slots: torch.Tensor, meter: TrafficMeter | None):
    """Generator: send per-row slot ids (int32 [R, K]) over one hop; returns long [R_recv, K]."""
    buf = raw_bytes(row_slots.to(torch.int32))
    out, work = hop.start(buf, [("slots", buf.shape[1])], meter=meter)
    yield
    work.wait()
    return from_raw(out, torch.int32).view(-1, row_slots.shape[1]).long()


def broadcast(
    plan: TwoHopPlan,
    x: torch.Tensor,
    fmt: WireFormat,
    extra: torch.Tensor | None = None,
    kind: str = "dispatch",
    phase: str = "forward",
):
    """Generator: rows x [N, D] (and per-row fp32 ``extra`` [N, K]) to every rank holding their experts.

    Encoded once at the source; the forwarder passes the bytes on untouched. Returns (x_e [R2r, D] in
    x's dtype, extra_e [R2r, K] or None)."""
    dim = x.shape[1]
    parts, fields = [fmt.encode(x)], [(kind, fmt.row_bytes(dim))]
    if extra is not None:
        parts.append(raw_bytes(extra.float()))
        fields.append(("gate", 4 * extra.shape[1]))
    buf = pack_fields(parts)
    out1, work = plan.h1.start(buf[plan.h1_token], fields, meter=plan.meter, phase=phase)
    yield
    work.wait()
    out2, work = plan.h2.start(out1[plan.h2_row], fields, meter=plan.meter, phase=phase)
    yield
    work.wait()
    width = fields[0][1]
    x_e = fmt.decode(out2[:, :width], dim, x.dtype)
    extra_e = from_raw(out2[:, width:], torch.float32).view(-1, extra.shape[1]) if extra is not None else None
    return x_e, extra_e


def reduce(
    plan: TwoHopPlan,
    y: torch.Tensor,
    intra_fmt: WireFormat,
    inter_fmt: WireFormat,
    extra: torch.Tensor | None = None,
    kind: str = "combine",
    phase: str = "forward",
):
    """Generator: the reverse of ``broadcast``, summing. Rows y [R2r, D] (and fp32 ``extra`` [R2r, K])
    go back to the forwarders, which sum them per inter-node row in fp32, re-encode once, and send one
    row per node to the source, which sums its nodes. Returns (y [N, D] in y's dtype, extra [N, K])."""
    y1, extra1 = yield from _reduce_hop(
        plan.h2, plan.h2_row, plan.h1.recv, y, extra, intra_fmt, kind, plan, phase
    )
    y0, extra0 = yield from _reduce_hop(
        plan.h1, plan.h1_token, [plan.n_tokens], y1, extra1, inter_fmt, kind, plan, phase
    )
    return y0.to(y.dtype), extra0


def _reduce_hop(
    hop: Hop,
    rows: torch.Tensor,
    into: list[int],
    y: torch.Tensor,
    extra: torch.Tensor | None,
    fmt: WireFormat,
    kind: str,
    plan: TwoHopPlan,
    phase: str,
):
    """Generator: send rows back over one hop and sum them into ``sum(into)`` rows (fp32)."""
    dim = y.shape[1]
    parts, fields = [fmt.encode(y)], [(kind, fmt.row_bytes(dim))]
    if extra is not None:
        parts.append(raw_bytes(extra.float()))
        fields.append(("gate", 4 * extra.shape[1]))
    out, work = hop.start(pack_fields(parts), fields, reverse=True, meter=plan.meter, phase=phase)
    yield
    work.wait()
    width, n = fields[0][1], sum(into)
    back = fmt.decode(out[:, :width], dim, torch.float32)
    summed = back.new_zeros(n, dim).index_add_(0, rows, back)
    extra_sum = None
    if extra is not None:
        back_extra = from_raw(out[:, width:], torch.float32).view(-1, extra.shape[1])
        extra_sum = back_extra.new_zeros(n, extra.shape[1]).index_add_(0, rows, back_extra)
    return summed, extra_sum
