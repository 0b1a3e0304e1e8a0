"""Token dispatchers: how routed (token, expert) pairs reach the experts that compute them, and how the
expert outputs come back. The MoE layer is Router -> TokenDispatcher -> GroupedExperts; this module holds
the interface and the local dispatcher (every expert in this process, no communication). The two-hop
expert-parallel dispatcher over torch.distributed (``dsv3.parallel.ep``) has the same interface.

Both methods are generators: a dispatcher yields while a collective is in flight, so a driver can run
another micro-batch's compute meanwhile (``dsv3.parallel.overlap``); ``run`` drives one to completion.
The local dispatcher never yields.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Steps = Generator[None, None, Any]


def run(steps: Steps) -> Any:
    """Drive a step generator to completion, waiting on each collective at once; return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass
class Routing:
    """The router's decisions for N tokens: expert ids [N, K] and gate values [N, K] (fp32)."""

    idx: torch.Tensor
    weights: torch.Tensor


@dataclass
class ExpertRows:
    """What grouped experts compute on: rows x [R, D] and the (row, expert) pairs that read them, grouped
    by local expert: ``token [S]`` (a row of x), ``gates [S]``, ``counts[e]`` pairs for local expert e.
    The experts return out [R, D] with out[token] += gate * expert(x[token])."""

    x: torch.Tensor
    token: torch.Tensor
    gates: torch.Tensor
    counts: list[int]


def group_by_expert(x: torch.Tensor, row: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor,
                    n_experts: int) -> ExpertRows:
    """Pairs (row of x, expert, gate), each [S], grouped by expert for the experts: a stable sort, so
    each expert sees its rows in their order. Every dispatcher ends its dispatch here."""
    order = expert.argsort(stable=True)
    counts = torch.bincount(expert, minlength=n_experts).tolist()
    return ExpertRows(x, row[order], gate[order], counts)


class TokenDispatcher(nn.Module):
    """Moves token rows to the experts they were routed to and the outputs back.

    ``dispatch(x [N, D], routing)`` is a generator returning (ExpertRows for this process's experts, a
    handle); ``combine(y [R, D], handle)`` a generator returning the per-token sum y [N, D]. A
    dispatcher holds no parameters (it is a module so that ``.to()`` and ``.train()`` reach it)."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Steps:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle: Any) -> Steps:
        raise NotImplementedError


class LocalDispatcher(TokenDispatcher):
    """Every expert lives here: the pairs are sorted by expert (stable, so each expert sees its tokens in
    order) and the experts' per-token sums are the output; nothing moves.

    ``combine_format`` (bf16, e4m3, e5m2, logfmt8, logfmt10) simulates a combine all-to-all in that
    format: the output takes the format's round trip (gradients pass straight through), as an
    expert-parallel combine would deliver it; None leaves it exact."""

    def __init__(self, n_experts: int, combine_format: str | None = None):
        super().__init__()
        self.n_experts = n_experts
        self.combine_format = combine_format

    @staticmethod
    def is_exact(dispatcher: TokenDispatcher) -> bool:
        """Whether ``dispatcher`` is a plain local one with an exact combine: what the decode fast paths
        (``FastDecode``, ``StaticDecode``) can replace by computing the routed experts themselves."""
        return type(dispatcher) is LocalDispatcher and dispatcher.combine_format is None

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Steps:
        yield from ()  # no communication: never yields
        expert = routing.idx.flatten()  # pair p = (token p // K, its (p % K)-th choice)
        token = torch.arange(expert.numel(), device=expert.device) // routing.idx.shape[1]
        return group_by_expert(x, token, expert, routing.weights.flatten(), self.n_experts), None

    def combine(self, y: torch.Tensor, handle: Any) -> Steps:
        yield from ()
        if self.combine_format is None:
            return y
        from dsv3.precision.logfmt import quantize_moe_output

        return quantize_moe_output(y, self.combine_format)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, combine_format={self.combine_format}"


def local_rows(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, n_experts: int) -> ExpertRows:
    """The rows a local dispatcher hands the experts for tokens x [N, D] routed to idx/weights [N, K]."""
    rows, _ = run(LocalDispatcher(n_experts).dispatch(x, Routing(idx, weights)))
    return rows
