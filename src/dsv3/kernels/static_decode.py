"""A decode step whose shapes never change, for ``torch.compile`` and CUDA graphs (gpt-fast's approach).

On a GPU a decode step of a small batch is bound by launch overhead, not by bytes: the module path issues
thousands of small kernels per token. Compiled into one graph and replayed as a CUDA graph, the step costs
a few launches. That needs every shape and every Python-level value to stay the same from step to step,
which the engine's step does not give: its cache grows with the batch, ``start_pos`` is a Python int (a
new graph per position), the routed experts run on data-dependent row counts. Here:

* the latent cache is a pool of pages that never moves, held as buffers of this module (the engine's own
  pool, ``infer.page_pool``, or, standing alone, a plain cache of ``batch`` rows x ``max_len`` slots: one page
  per row), so a CUDA graph sees the same addresses every replay; each row's slots are found through the
  buffers ``table`` and ``shift`` (``LatentCache.paged``'s page table, a fixed [batch, max_len / page_tokens]),
  copied into before a step (``map``), so a batch that gains, loses or moves rows needs no new graph and no
  copy of the cache;
* the step writes its latents at ``slot``, a 0-d tensor, with one ``index_put_`` into the pool (rows past the
  batch, mapped to the blank page, write zeros there), and attends over all ``max_len`` slots through a mask
  (slot <= the current one, the slots the row holds, and ``valid``, the engine's per-row slots): on the
  module path each row's slots gathered through their flat indices, on the CPU ops read in place;
* the routed experts run as one grouped GEMM over the (row, expert) pairs sorted by expert
  (``kernels.grouped_swiglu``: each routed-to expert's weights read once, every shape fixed), where
  ``torch._grouped_mm`` runs the weights (bf16; on CUDA, compute capability 9.0 on); elsewhere each row
  gathers its top-k experts' weights (``kernels.gathered_swiglu``: at one row the same bytes, at many rows
  each row's own copy).

Everything else is the model's own modules (norms, projections, router, shared experts, head), and the
attention is ``MLA.latent_attention``, the absorbed path's own code, so the step equals the module path
(tests/kernels/test_static_decode.py). Plain decode only (no MTP drafting), on plain ``GroupedExperts`` with
the local dispatcher: the layouts a single GPU serves.

On the CPU the same step runs the per-op path's own code (``decode.AttentionPlan.project`` and ``.attend``,
``decode.FeedForwardPlan``, ``decode.rms_norm``), only its latents stored in the pool (``_store``) and its
attention reading every slot through ``table``, ``shift`` and the mask: the projections, norms, router,
experts, head and the absorbed attention each one of the decode kernels' custom ops (``torch.ops.dsv3.*``,
``kernels/ops.py``) that reads the weights in place (the C kernels where they are built, else their PyTorch
references), so the step compiles (``fullgraph=True``) into a graph of those ops. A model they cannot read (a
linear layer with a bias, a hook) runs the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.kernels import decode_kernels as dk
from dsv3.kernels.decode import AttentionPlan, FeedForwardPlan, rms_norm, weight_of
from dsv3.model.dispatch import LocalDispatcher
from dsv3.model.experts import GroupedExperts
from dsv3.model.kernels import gathered_swiglu, grouped_swiglu
from dsv3.model.mla import MLA, LatentCache
from dsv3.model.moe import MoE
from dsv3.model.norm import RMSNorm
from dsv3.model.transformer import Transformer


def unsupported(model: Transformer) -> str | None:
    """Why ``StaticDecode`` cannot run this model, or None."""
    for i, layer in enumerate(model.main_layers):
        hooked = [m for m in (layer, layer.self_attn, layer.mlp) if m._forward_hooks or m._forward_pre_hooks]
        if hooked:
            return f"layer {i} has forward hooks, which a static step does not call"
        mlp = layer.mlp
        if isinstance(mlp, MoE) and (type(mlp.experts) is not GroupedExperts
                                     or not LocalDispatcher.is_exact(mlp.dispatcher)):
            return (f"layer {i}'s experts are {type(mlp.experts).__name__} behind {type(mlp.dispatcher).__name__}; "
                    "a static step needs plain GroupedExperts with the local dispatcher")
    return None


def grouped_mm_runs(w_gate: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``grouped_swiglu`` can run these experts' weights (w_gate [E, I, D], w_down [E, D, I]) inside a
    compiled graph and a CUDA graph: ``torch._grouped_mm`` takes bf16 (its compiled form only bf16), rows of
    whole 16-byte units, and on CUDA only compute capability 9.0 on runs it without reading the group offsets
    back to the host (below that, a fallback does, which a CUDA graph cannot capture). On CUDA it must also
    pass ``_grouped_mm_probe`` once per device."""
    if w_gate.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if w_gate.shape[-1] % 8 or w_gate.shape[-2] % 8:
        return False
    device = w_gate.device
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and _grouped_mm_probe(device))


_PROBED: dict[torch.device, bool] = {}


def _grouped_mm_probe(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` gives per-group matmuls (transposed weights, an empty group)
    in bf16: probed once, so that a build whose grouped GEMM fails or errs leaves the static step on
    ``gathered_swiglu`` instead of failing it."""
    if device not in _PROBED:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 32, generator=g).to(device, torch.bfloat16)
        w = torch.randn(3, 48, 32, generator=g).to(device, torch.bfloat16)  # [E, N, K], read transposed
        ends = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
        want = torch.cat([x[:3].float() @ w[0].float().t(), x[3:].float() @ w[2].float().t()])
        try:
            got = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends).float()
            _PROBED[device] = bool(((got - want).norm() / want.norm()) < 1e-2)
        except (RuntimeError, NotImplementedError):
            _PROBED[device] = False
    return _PROBED[device]


class StaticDecode(nn.Module):
    """Greedy-ready decode over a fixed ``batch`` x ``max_len`` latent cache: ``prefill`` once, then call
    the module (compiled or not) once per step. ``compiled(mode)`` gives the compiled step
    (``mode="reduce-overhead"`` on CUDA captures it as a CUDA graph).

    The cache is a pool of pages kv [L, P, page_tokens, r] and pe [L, P, page_tokens, rope] read and written
    in place through the buffers ``table`` [batch, max_len / page_tokens] (int32, -1: no page) and ``shift``
    [batch] (int64), ``LatentCache.paged``'s layout. Without ``pages`` the step owns a plain cache, one page of
    ``max_len`` slots per row (row b is page b). With ``pages`` (an engine's pool; ``blank`` its page of zeros)
    ``map`` points the buffers at a batch's rows before each step, and the pool is never copied."""

    def __init__(self, model: Transformer, batch: int, max_len: int, cache_dtype: torch.dtype | None = None,
                 pages: tuple[torch.Tensor, torch.Tensor] | None = None, blank: int = -1):
        super().__init__()
        why = unsupported(model)
        if why:
            raise DSV3Error(f"cannot build a static decode step: {why}")
        self.model = model.eval()
        device = model.inv_freq.device
        self.plain = pages is None
        if pages is None:  # one page per row: [L, B, max_len, .]
            cache = model.new_cache(batch, max_len, dtype=cache_dtype or next(model.parameters()).dtype)
            pages, blank = (cache.kv.to(device), cache.pe.to(device)), -1
        self.register_buffer("kv", pages[0], persistent=False)  # [L, P, page_tokens, r]: the pool itself
        self.register_buffer("pe", pages[1], persistent=False)  # [L, P, page_tokens, rope]
        self.blank = blank  # the page of zeros padding rows read (-1: none, a plain cache has no padding)
        n = self.kv.shape[2]
        cols = -(-max_len // n)
        table = torch.arange(batch, dtype=torch.int32)[:, None] if self.plain else torch.full((batch, cols), blank)
        self.register_buffer("table", table.to(torch.int32).to(device), persistent=False)  # [B, cols]
        self.register_buffer("shift", torch.zeros(batch, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("slots", torch.arange(cols * n, device=device), persistent=False)  # [S]
        # on the CPU: each block's weights as the ops read them, and the head's (None: the modules run)
        self.plans = self._kernel_plans() if self.kv.device.type == "cpu" else None
        self.head = weight_of(model.lm_head)
        # decided here, not in the traced step (the device's capability is a query a graph should not make)
        self.grouped = all(grouped_mm_runs(m.experts.gate_proj, m.experts.down_proj) for m in model.moe_layers())

    @property
    def max_len(self) -> int:
        """Slots each row attends over (``max_len`` rounded up to whole pages)."""
        return self.slots.shape[0]

    def _kernel_plans(self) -> list[tuple[AttentionPlan, FeedForwardPlan]] | None:
        """Each block's weights as the CPU ops read them, or None when one of them (or the head) cannot be read."""
        m = self.model
        dtype = m.model.embed_tokens.weight.dtype
        plans = [(AttentionPlan(layer.self_attn, dtype), FeedForwardPlan(layer.mlp)) for layer in m.main_layers]
        norms = [n for layer in m.main_layers for n in layer.modules() if isinstance(n, RMSNorm)]
        if (weight_of(m.lm_head) is None or not all(a.ok and f.ok for a, f in plans)
                or any(type(n) is not RMSNorm for n in [*norms, m.model.norm])):
            return None
        return plans

    @property
    def cache(self) -> LatentCache:
        """The step's cache as a LatentCache (same tensors), for the model's own prefill: the plain cache, or
        the pool seen through the current ``table`` and ``shift`` (copies on the CPU, where LatentCache keeps them)."""
        if not self.plain:
            return LatentCache.paged(self.kv, self.pe, self.table.cpu(), self.shift.cpu(), self.blank)
        view = self.model.new_cache(0, 0, dtype=self.kv.dtype)
        view.kv, view.pe = self.kv, self.pe
        return view

    def map(self, cache: LatentCache) -> None:
        """Point the step at the rows of ``cache``, a paged view of this step's pool (``LatentCache.paged``):
        its page table and shifts copied into ``table`` and ``shift`` (the pages stay where they are); rows past
        the cache's are padding, mapped to the blank page (they read zeros, and write zeros there)."""
        if cache.kv is not self.kv or cache.table is None or self.plain:
            raise ValueError("StaticDecode.map needs a paged view of the pool the step was built over")
        B, cols = cache.rows, min(cache.table.shape[1], self.table.shape[1])
        table = torch.full(self.table.shape, -1, dtype=torch.int32)
        table[:B, :cols] = cache.table[:, :cols]
        table[B:] = self.blank
        shift = torch.zeros(self.shift.shape, dtype=torch.int64)
        shift[:B] = cache.shift
        self.table.copy_(table)
        self.shift.copy_(shift)

    def _places(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where slots ``at`` [B, n] (long) of each row lie: flat indices [B, n] into a layer's pages
        (page * page_tokens + offset; the blank page's first slot for one the row does not hold) and whether the
        row holds it (bool [B, n]), by ``LatentCache.slots``'s formula on the buffers."""
        n, cols = self.kv.shape[2], self.table.shape[1]
        q = at - self.shift[:, None]
        page = self.table.to(torch.int64).gather(1, q.div(n, rounding_mode="floor").clamp(0, cols - 1))
        held = (q >= 0) & (q < cols * n) & (page >= 0)
        return torch.where(held, page * n + q % n, max(self.blank, 0) * n), held

    def _writer(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row writes slot ``slot``: flat indices [B] and bool [B, 1], False for a padding row (mapped
        to the blank page) or a slot the row does not hold, whose latents are written as zeros on the blank page."""
        at, held = self._places(slot.view(1, 1).expand(self.shift.shape[0], 1))
        page = at.div(self.kv.shape[2], rounding_mode="floor")
        return at[:, 0], held & (page != self.blank)

    @torch.no_grad()
    def prefill(self, ids_BP: torch.Tensor) -> torch.Tensor:
        """The model's own prefill of prompts ids [B, P] (equal lengths) into the static cache; returns the
        logits [B, V] after each prompt's last token."""
        return self.model(ids_BP, cache=self.cache, start_pos=0)[:, -1]

    @torch.no_grad()
    def forward(self, ids_B1: torch.Tensor, positions_B1: torch.Tensor, slot: torch.Tensor,
                valid_BS: torch.Tensor) -> torch.Tensor:
        """One decode step: tokens ids [B, 1] at RoPE positions [B, 1], written at cache slot ``slot`` (0-d
        long tensor; every row's, as the engine's rows share a slot counter); each row attends to the slots up
        to ``slot`` that ``valid`` [B, max_len] allows and it holds. Returns the logits [B, V]."""
        m = self.model
        cos, sin = m.angles(positions_B1)
        read, held = self._places(self.slots.expand(self.shift.shape[0], -1))
        allowed_B1S = (valid_BS & held & (self.slots <= slot))[:, None]
        write = self._writer(slot)
        x = m.model.embed_tokens(ids_B1)
        if self.plans is not None:
            return self._kernel_step(x, cos, sin, write, allowed_B1S)
        for layer in m.main_layers:
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, write, read, allowed_B1S)
            x = x + self._feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        return m.lm_head(m.model.norm(x))[:, -1]

    def _store(self, layer: int, write: tuple[torch.Tensor, torch.Tensor], c_kv: torch.Tensor,
               k_pe: torch.Tensor) -> None:
        """Write each row's latents c_kv [B, 1, r], k_pe [B, 1, rope] in place at its flat index (zeros where
        ``write`` says the row writes none: the blank page stays blank). One ``index_put_`` on the whole pool,
        not on a view of it: compiled, a view's mutation is functionalized into a copy of the whole pool every
        step, the whole tensor's is done in place (tests/kernels/test_graph_decode.py checks it)."""
        at, live = write
        n = self.kv.shape[2]
        where = (torch.full_like(at, layer), at.div(n, rounding_mode="floor"), at % n)
        for pages, new in ((self.kv, c_kv), (self.pe, k_pe)):
            new = torch.where(live, new[:, 0], torch.zeros((), dtype=new.dtype, device=new.device))
            pages.index_put_(where, new.to(pages.dtype))

    def _attention(self, mla: MLA, x: torch.Tensor, cos, sin, write, read: torch.Tensor, allowed: torch.Tensor):
        """MLA's absorbed decode over the pages: the latents stored, then each row's slots gathered through
        ``read`` [B, S] (flat indices) for ``MLA.latent_attention``."""
        q_nope, q_pe = mla._query(x, cos, sin)
        c_kv, k_pe = mla.latent(x, cos, sin)
        self._store(mla.layer_idx, write, c_kv, k_pe)
        kv, pe = (t[mla.layer_idx].flatten(0, 1)[read].to(x.dtype) for t in (self.kv, self.pe))  # [B, S, .]
        out = mla.latent_attention(q_nope, q_pe, kv, pe, allowed)
        return mla.o_proj(out.flatten(2))

    def _kernel_step(self, x: torch.Tensor, cos, sin, write, allowed_B1S: torch.Tensor) -> torch.Tensor:
        """``forward`` from the embeddings x [B, 1, D] on, over the CPU ops (the per-op path's code, as
        ``decode.BlockPlan`` runs it, on the pool): the logits [B, V]."""
        bias = torch.zeros(allowed_B1S.shape).masked_fill(~allowed_B1S, float("-inf"))
        rot = torch.complex(cos, sin).unsqueeze(-2)  # [B, 1, 1, rope/2]: the per-op path's rotation
        for layer, (attention, feed_forward) in zip(self.model.main_layers, self.plans, strict=True):
            h = rms_norm(layer.input_layernorm, x, True)
            x = x + self._kernel_attention(attention, h, rot, cos, sin, write, bias)
            x = x + feed_forward(rms_norm(layer.post_attention_layernorm, x, True), True, count=False)
        return dk.linear(rms_norm(self.model.model.norm, x, True), self.head)[:, -1]

    def _kernel_attention(self, plan: AttentionPlan, x: torch.Tensor, rot, cos, sin, write,
                          bias: torch.Tensor) -> torch.Tensor:
        """MLA's absorbed decode over the pages in ops: the plan's projections, the latents stored (``_store``),
        then the plan's attention, one ``dsv3::mla_decode`` reading every slot in place through ``table`` and
        ``shift`` (``bias`` hides the ones not allowed)."""
        q, c_kv, k_pe = plan.project(x, rot, True)
        i = plan.mla.layer_idx
        self._store(i, write, c_kv, k_pe)
        return plan.attend(q, cos, sin, self.kv[i], self.pe[i], bias, True, table=self.table, shift=self.shift,
                           slots=self.max_len)

    def _feed_forward(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(mlp, MoE):
            return mlp(h)
        flat = h.flatten(0, 1)
        idx, gates, _ = mlp.gate(flat)
        e = mlp.experts
        routed = grouped_swiglu if self.grouped else gathered_swiglu
        out = routed(flat, idx, gates, e.gate_proj, e.up_proj, e.down_proj).view_as(h)
        return out if mlp.shared_experts is None else out + mlp.shared_experts(h)

    def compiled(self, mode: str | None = None):
        """The step compiled as one graph (``fullgraph``: a graph break is an error, not a slow path)."""
        return torch.compile(self, fullgraph=True, dynamic=False, mode=mode)


@torch.no_grad()
def greedy(step, static: StaticDecode, prompt_BP: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] of equal-length prompts through ``step`` (``static`` itself or
    its compiled form): the loop a benchmark times."""
    B, P = prompt_BP.shape
    valid = torch.zeros(B, static.max_len, dtype=torch.bool, device=prompt_BP.device)
    valid[:, :P] = True
    token = static.prefill(prompt_BP).argmax(-1)
    out = [token]
    for i in range(new_tokens - 1):
        slot = torch.tensor(P + i, device=prompt_BP.device)
        valid[:, P + i] = True
        token = step(token[:, None], slot.expand(B)[:, None], slot, valid).argmax(-1)
        out.append(token)
    return torch.stack(out, dim=1)
