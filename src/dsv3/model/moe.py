"""DeepSeekMoE (V3 §2.1.2): shared experts plus fine-grained routed experts, group-limited routing,
aux-loss-free balancing through a selection-only bias, and the complementary sequence-wise balance loss.

The routed part is Router -> TokenDispatcher -> GroupedExperts: the router picks experts (fp32), a
dispatcher moves rows to where their experts live and back (``LocalDispatcher`` here, the two-hop
expert-parallel one in ``dsv3.parallel.ep``), grouped experts compute on the rows they receive (plain,
FP8 training GEMMs or resident FP8, ``experts.py``). Any dispatcher works with any kind of experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv3.config import ModelConfig
from dsv3.model.dispatch import LocalDispatcher, Routing, Steps, TokenDispatcher, run
from dsv3.model.experts import GroupedExperts

# The router stays fp32 whatever the model's dtype (DeepSeek's rule, which transformers follows): its
# scores are computed in fp32 (Router.scores) and these tensors are stored and loaded in fp32.
ROUTER_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def stays_fp32(name: str) -> bool:
    """True for the state-dict or checkpoint names of the router's tensors, which are kept in fp32."""
    return name.endswith(ROUTER_FP32_SUFFIXES)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Dense layers and shared experts."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The gate: affinity scores, group-limited top-k selection, gate values.

    ``e_score_correction_bias`` (fp32) shifts the scores used to *select* experts and to score groups
    (noaux_tc); the gate values always come from the unbiased scores. Group limiting keeps the
    ``topk_group`` best of ``n_group`` groups (one group per node in V3, so it is node-limited routing).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        self.method, self.scoring = cfg.topk_method, cfg.scoring_func
        self.norm_topk_prob, self.route_scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        # Only noaux_tc (V3) has the bias; V2 checkpoints do not carry it.
        bias = torch.zeros(cfg.n_routed_experts, dtype=torch.float32) if self.method == "noaux_tc" else None
        self.register_buffer("e_score_correction_bias", bias)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Affinities s [N, E] in fp32 from x [N, D]."""
        logits = F.linear(x.float(), self.weight.float())
        return logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert indices [N, K]: top-k of the (biased) scores within the kept groups."""
        noaux = self.method == "noaux_tc"
        return select_experts(scores, self.e_score_correction_bias if noaux else None,
                              self.n_group if self.method != "greedy" else 1, self.topk_group, self.top_k, noaux)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert indices [N, K], gate values [N, K] fp32, scores [N, E] fp32)."""
        scores = self.scores(x)
        with torch.no_grad():
            idx = self.select(scores.detach())
        return idx, gate_values(scores, idx, self.norm_topk_prob, self.route_scale), scores


def select_experts(scores: torch.Tensor, bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                   group_sum: bool) -> torch.Tensor:
    """Expert indices [N, K]: the top-k of scores [N, E] (plus ``bias``, which only selects) among the
    ``topk_group`` best of ``n_group`` groups, a group scored by its two best (``group_sum``, noaux_tc) or its
    best. The router's selection as plain tensors, which the decode kernels' reference shares."""
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choice.unflatten(-1, (n_group, -1))  # [N, G, E/G]
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if group_sum else grouped.amax(dim=-1)
        keep = group_score.topk(topk_group, dim=-1).indices  # [N, topk_group]
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
    return choice.topk(top_k, dim=-1).indices


def gate_values(scores: torch.Tensor, idx: torch.Tensor, normalize: bool, route_scale: float) -> torch.Tensor:
    """The gate values [N, K] fp32 of the chosen experts ``idx``: their unbiased scores, normalised to sum 1
    (``normalize``, with more than one expert) and times ``route_scale``."""
    weights = scores.gather(1, idx)
    if normalize and idx.shape[-1] > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale


class MoE(nn.Module):
    """Routed experts + shared experts, with the balancing state that training reads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.aux_alpha = cfg.aux_loss_alpha
        self.gate = Router(cfg)
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.n_routed_experts)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        # Tokens this process routed to each expert since the last bias update (the load the aux-free rule
        # reads; a data-parallel trainer sums it over ranks before the update).
        self.register_buffer("expert_load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # The logical experts that ``experts`` holds, in slot order, when a loader kept only a future
        # expert-parallel rank's share (`hold_experts`); None: every expert, in order.
        self.held_experts: torch.Tensor | None = None
        # Counters of the routed tokens kept in any mode (a server's /metrics, ``dsv3.infer.metrics``):
        # every path that routes this layer's tokens calls each with the chosen experts. Counting here
        # rather than in a forward hook keeps the fast decode path usable (a hook forces a layer through
        # its modules). When the only counter has a ``kernel_counts`` tensor (int64 [n_experts], CPU), kernels
        # that route without Python (``dsv3.kernels.decode``'s block kernel) add their choices to it instead.
        self.routed_counters: list[Callable[[torch.Tensor], None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]. Under an expert-parallel dispatcher every rank must call it."""
        return run(self.steps(x))

    def steps(self, x: torch.Tensor) -> Steps:
        """Generator: the layer's forward, yielding whenever the dispatcher has a collective in flight
        (so two micro-batches can overlap, ``dsv3.parallel.overlap``); returns [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        routing = self.route(flat, B, T)
        rows, handle = yield from self.dispatcher.dispatch(flat, routing)
        y = self.experts(rows)
        out = (yield from self.dispatcher.combine(y, handle)).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def hold_experts(self, ids: torch.Tensor) -> None:
        """Keep only the experts ``ids`` (logical ids, in slot order): what a rank loads when it will join an
        expert-parallel group that gives it exactly those (`dsv3.parallel.ep.make_expert_parallel`). Until
        then the layer cannot run: its local dispatcher expects every expert."""
        self.experts = self.experts.select(ids)
        self.held_experts = ids

    def route(self, flat: torch.Tensor, B: int, T: int) -> Routing:
        """The router's choice for flat [B*T, D]; in training also counts the load and the balance loss."""
        idx, weights, scores = self.gate(flat)
        self.count_routed(idx)
        if self.training:
            self.expert_load += torch.bincount(idx.flatten(), minlength=self.n_experts).to(self.expert_load)
            self.aux_loss = self._sequence_balance_loss(idx.view(B, T, -1), scores.view(B, T, -1))
        return Routing(idx, weights)

    def count_routed(self, idx: torch.Tensor) -> None:
        """Give the experts chosen in ``idx`` (expert indices of any shape) to every counter in
        ``routed_counters``."""
        for count in self.routed_counters:
            count(idx)

    def _sequence_balance_loss(self, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        """alpha * sum_i f_i P_i per sequence, averaged over the batch (V3 eqs. 17-20)."""
        if self.aux_alpha <= 0:
            return None
        B, T, _ = idx.shape
        counts = torch.zeros(B, self.n_experts, device=idx.device).scatter_add_(
            1, idx.flatten(1), torch.ones(B, T * self.top_k, device=idx.device))
        f = counts * self.n_experts / (self.top_k * T)  # [B, E]
        p = (scores / scores.sum(-1, keepdim=True)).mean(dim=1)  # [B, E]
        return self.aux_alpha * (f * p).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, speed: float) -> dict[str, float]:
        """Aux-loss-free balancing: b_i += speed * sign(mean load - load_i); resets the load counter.
        Returns the max/mean load imbalance that the update saw."""
        load = self.expert_load
        mean = load.mean()
        stats = {"max_over_mean": float(load.max() / mean) if mean > 0 else 0.0}
        if speed > 0 and mean > 0 and self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias += speed * torch.sign(mean - load)
        load.zero_()
        return stats
