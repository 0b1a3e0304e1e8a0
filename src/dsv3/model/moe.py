"""DeepSeekMoE (V3 §2.1.2): shared experts plus fine-grained routed experts, group-limited routing,
aux-loss-free balancing through a selection-only bias, and the complementary sequence-wise balance loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv3.config import ModelConfig
from dsv3.model.autocast import compute_dtype


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
        choice = scores + self.e_score_correction_bias if self.method == "noaux_tc" else scores
        if self.method != "greedy" and self.n_group > 1:
            grouped = choice.unflatten(-1, (self.n_group, -1))  # [N, G, E/G]
            if self.method == "noaux_tc":
                group_score = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_score = grouped.amax(dim=-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices  # [N, topk_group]
            kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        return choice.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert indices [N, K], gate values [N, K] fp32, scores [N, E] fp32)."""
        scores = self.scores(x)
        with torch.no_grad():
            idx = self.select(scores.detach())
        weights = scores.gather(1, idx)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.route_scale, scores


class _RoutedSwiGLU(torch.autograd.Function):
    """The routed experts of one MoE layer in one autograd node: for every expert e and its rows,
    out[token] += gate * down_e(silu(gate_e(x[token])) * up_e(x[token])).

    ``token [S]`` lists rows of ``x [N, D]`` sorted by expert (``counts[e]`` rows each) and ``gates [S]``
    their gate values. Each expert's slice runs as a few small matmuls whose temporaries stay in cache;
    nothing of size [S, D] is ever built, the gate values scale the [S, I] activation rather than the
    [S, D] output, and the backward writes each expert's weight gradient straight into one [E, ...]
    buffer. Only the two [S, I] projections are saved for backward (plain autograd keeps the gathered
    [S, D] input and five [S, I] tensors). Under autocast everything runs in the autocast dtype, as
    ``nn.Linear`` would; gradients come back in each input's own dtype."""

    @staticmethod
    def forward(ctx, x, gates, token, counts, w_gate, w_up, w_down):
        ctx.dtypes = (x.dtype, gates.dtype, w_gate.dtype)
        dtype = compute_dtype(x)
        x, gates, w_gate, w_up, w_down = (t.to(dtype) for t in (x, gates, w_gate, w_up, w_down))
        g = x.new_empty(token.numel(), w_gate.shape[1])  # [S, I] gate projection, kept for backward
        u = torch.empty_like(g)  # [S, I] up projection, kept for backward
        with torch.autocast(x.device.type, enabled=False):
            out = routed_forward(x, gates, token, counts, lambda e: (w_gate[e], w_up[e], w_down[e]), g, u)
        ctx.save_for_backward(x, gates, token, g, u, w_gate, w_up, w_down)
        ctx.counts = counts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gates, token, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gates = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w = ctx.needs_input_grad[4:7]
        grad_out = grad_out.to(x.dtype)
        grad_x = torch.zeros_like(x) if need_x else None
        grad_gates = torch.empty_like(gates) if need_gates else None
        grad_w = [_expert_grad_buffer(w, ctx.counts) if need else None
                  for w, need in zip((w_gate, w_up, w_down), need_w, strict=True)]
        with torch.autocast(x.device.type, enabled=False):
            for e, rows in _expert_slices(ctx.counts):
                tok = token[rows]
                go, ge, ue, gate = grad_out[tok], g[rows], u[rows], gates[rows, None]  # [n, D], [n, I] x2, [n, 1]
                sig = torch.sigmoid(ge)
                act = ge * sig * ue  # silu(g) * u
                if grad_w[2] is not None:
                    torch.mm(go.t(), act * gate, out=grad_w[2][e])
                d_act = go @ w_down[e]  # [n, I]
                if grad_gates is not None:
                    grad_gates[rows] = (d_act * act).sum(-1)
                d_act.mul_(gate)
                d_up = d_act * ge * sig
                d_gate = d_act.mul_(ue).mul_(sig).mul_(1 + ge * (1 - sig))  # silu'(g) = sig * (1 + g (1 - sig))
                xe = x[tok]
                if grad_w[0] is not None:
                    torch.mm(d_gate.t(), xe, out=grad_w[0][e])
                if grad_w[1] is not None:
                    torch.mm(d_up.t(), xe, out=grad_w[1][e])
                if grad_x is not None:
                    grad_x.index_add_(0, tok, torch.addmm(d_gate @ w_gate[e], d_up, w_up[e]))
        x_dtype, gates_dtype, w_dtype = ctx.dtypes
        grads_w = [None if gw is None else gw.to(w_dtype) for gw in grad_w]
        return (None if grad_x is None else grad_x.to(x_dtype),
                None if grad_gates is None else grad_gates.to(gates_dtype), None, None, *grads_w)


def routed_forward(x, gates, token, counts, expert_weights, g=None, u=None) -> torch.Tensor:
    """The routed experts' forward, one expert's slice at a time: out[token] += gate * SwiGLU_e(x[token]).

    ``expert_weights(e)`` gives expert e's (gate [I, D], up [I, D], down [D, I]) weights, so lazily
    dequantized inference weights run the very same arithmetic as training's. ``g``/``u`` [S, I], when
    given, receive the gate and up projections (what the backward needs)."""
    out = torch.zeros_like(x)
    for e, rows in _expert_slices(counts):
        tok = token[rows]
        xe = x[tok]
        w_gate, w_up, w_down = expert_weights(e)
        ge = torch.mm(xe, w_gate.t(), out=None if g is None else g[rows])
        ue = torch.mm(xe, w_up.t(), out=None if u is None else u[rows])
        act = F.silu(ge).mul_(ue).mul_(gates[rows, None])
        out.index_add_(0, tok, act @ w_down.t())
    return out


def _expert_grad_buffer(w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """An uninitialized [E, ...] gradient whose experts without tokens are zero (the others get written)."""
    grad = torch.empty_like(w)
    for e, n in enumerate(counts):
        if not n:
            grad[e].zero_()
    return grad


def _expert_slices(counts: list[int]):
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def routed_swiglu(x: torch.Tensor, gates: torch.Tensor, token: torch.Tensor, counts: list[int],
                  w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """sum over routed (token, expert) pairs of gate * SwiGLU_expert(x[token]) -> [N, D].

    x [N, D]; token [S] and gates [S] sorted by expert, ``counts[e]`` pairs for expert e;
    w_gate, w_up [E, I, D]; w_down [E, D, I]."""
    multiple = _row_multiple(x)
    if multiple > 1:
        token, gates, counts = _pad_groups(token, gates, counts, multiple)
    return _RoutedSwiGLU.apply(x, gates, token, counts, w_gate, w_up, w_down)


CPU_LOW_PRECISION_ROW_MULTIPLE = 32


def _row_multiple(x: torch.Tensor) -> int:
    """Row-count granularity of the per-expert matmuls. On a CPU in bf16/fp16 the matmul library
    compiles a kernel for every new shape, and expert row counts change every step (a nano-sized expert
    layer then costs 3x, `benchmarks/train_kernels.py --sections experts`); rounding the counts up to a
    multiple of 32 makes the shapes recur."""
    low = compute_dtype(x) in (torch.bfloat16, torch.float16)
    return CPU_LOW_PRECISION_ROW_MULTIPLE if x.device.type == "cpu" and low else 1


def _pad_groups(token: torch.Tensor, gates: torch.Tensor, counts: list[int], multiple: int):
    """Pads each expert's rows to a multiple of ``multiple`` with rows that read token 0 and carry gate 0:
    they add exactly zero to the output and to every gradient."""
    padded = [-(-n // multiple) * multiple for n in counts]
    if padded == counts:
        return token, gates, counts
    token_parts, gate_parts = [], []
    for (e, rows), n in zip(_expert_slices(counts), (n for n in padded if n), strict=True):
        extra = n - counts[e]
        token_parts += [token[rows], token.new_zeros(extra)]
        gate_parts += [gates[rows], gates.new_zeros(extra)]
    return torch.cat(token_parts), torch.cat(gate_parts), padded


class Experts(nn.Module):
    """The routed experts as stacked SwiGLU weights, computed grouped: tokens sorted by expert, one
    matmul per expert over a contiguous slice (no Python loop over tokens).
    Checkpoints store them one module per expert (``experts.E.gate_proj.weight``); see checkpoint.py."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, inter_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx/weights [N, K] -> sum_k weights * expert_idx(x): [N, D]."""
        n_experts = self.gate_proj.shape[0]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        token = order // idx.shape[1]
        gates = weights.flatten()[order]
        if isinstance(self.gate_proj, torch.Tensor):
            return routed_swiglu(x, gates, token, counts, self.gate_proj, self.up_proj, self.down_proj)
        # Inference's FP8 stand-ins dequantize lazily, one routed-to expert at a time.
        return routed_forward(x, gates.to(x.dtype), token, counts, self._expert_weights)

    def _expert_weights(self, e: int):
        return self.gate_proj[e], self.up_proj[e], self.down_proj[e]


class MoE(nn.Module):
    """Routed experts + shared experts, with the balancing state that training reads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.aux_alpha = cfg.aux_loss_alpha
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        # Tokens routed to each expert since the last bias update (the load the aux-free rule reads).
        self.register_buffer("expert_load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D]."""
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        idx, weights, scores = self.gate(flat)
        if self.training:
            self.expert_load += torch.bincount(idx.flatten(), minlength=self.n_experts).to(self.expert_load)
            self.aux_loss = self._sequence_balance_loss(idx.view(B, T, -1), scores.view(B, T, -1))
        out = self.experts(flat, idx, weights).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

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
