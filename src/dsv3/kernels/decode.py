"""The decode step with few, large operations: what the engine runs after prefill, beside the readable
module path (``Transformer.hidden_states``) that it must equal.

A decode step feeds one token (two when verifying an MTP draft) per row, so its cost is reading every
weight once plus a fixed cost per call; the module path makes about 4,000 PyTorch calls per step on the
``small`` shape, which dominated. Three layers, each tested against the one before:

* the module path (``Transformer.hidden_states``), the reference;
* the per-op path (``BlockPlan.__call__``): every projection, the output head and each MoE layer's routed
  experts through the kernels of ``decode_kernels`` (weights read in place in fp32, bf16 or FP8 blocks;
  all routed experts of a layer in one call, grouped by expert, so each routed-to expert is read once for
  all rows of a batch), the absorbed attention in one call over the cached latent, RoPE as one complex
  multiply, the mask built once per step as an additive bias, the router exactly as the model's
  (``Router.forward``) so the same experts are chosen, the RMSNorms in the block kernel's own C code (so
  the two paths agree to the bit in bf16). About 30 PyTorch calls per block. The static-shape step
  (``static_decode.StaticDecode``) runs this same code on the CPU, compiled into one graph, around its own
  cache write (``AttentionPlan.project``, then ``AttentionPlan.attend`` over its pool of pages);
* the block kernel (``BlockKernel``): the same computation, with the same roundings, as one C call per
  block (``dsv3_decode_block``), which reads a descriptor of the block's tensors made once per plan and
  one of the step made once per step: the fixed cost no longer grows with the number of layers;
* the step kernel (``StepKernel``): the embedding, every block kernel, the final norm and the head as one
  C call (``dsv3_decode_step``), so that the interpreter does not run between the weight streams (where
  each of its calls is slow: the weights have just evicted its working set from the caches). What remains
  in Python is the step's set-up (RoPE rows, descriptors, output tensors) and the checks that the model
  is still the one the kernels were made for.

A layer the kernels cannot run (forward hooks, an expert-parallel dispatcher or a simulated combine
format, experts of another kind, linear layers of another kind) runs through its own module, so the
result is always the model's. An MoE layer that counts its routed tokens (``MoE.routed_counters``: a
server's expert load) with a counter the kernels can add to (one with ``kernel_counts``) stays in the
block and step kernels, which add the experts they choose into that tensor; with any other counter its
block runs the attention half in the block kernel and the MoE half on the per-op path, where the chosen
experts are seen and counted. ``FastDecode(model, block_kernel=False)`` stops at the
per-op path and ``FastDecode(model, use_kernels=False)`` runs it with PyTorch matmuls in place of the C
kernels (tests compare all of them).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from dsv3.kernels import decode_kernels as dk
from dsv3.kernels.decode_kernels import ExpertWeights, Weight, kernel_status, linear, mla_decode, route, swiglu_experts
from dsv3.kernels.int_weights import IntExperts, IntExpertWeights, IntLinear, IntWeight, shared_expert_weights
from dsv3.model.dispatch import LocalDispatcher, TokenDispatcher
from dsv3.model.experts import GroupedExperts, ResidentFP8Experts
from dsv3.model.mla import MLA, LatentCache
from dsv3.model.moe import MLP, MoE
from dsv3.model.norm import RMSNorm
from dsv3.model.transformer import Block, MTPLayer, Transformer
from dsv3.precision.fp8_linear import FP8BlockLinear


def weight_of(module: nn.Module) -> Weight | None:
    """The kernels' view of a bias-free linear layer (plain, resident FP8 or integer groups), or None for any
    other."""
    if module._forward_hooks or module._forward_pre_hooks or getattr(module, "bias", None) is not None:
        return None
    if type(module) is nn.Linear:
        return Weight(module.weight.detach())
    if type(module) is FP8BlockLinear:
        return Weight(module.weight_fp8, module.weight_scale_inv, module.dtype)
    if type(module) is IntLinear:
        return IntWeight(module.weight_q, module.weight_scale)
    return None


def rms_norm(norm: RMSNorm, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
    """RMSNorm.forward in three calls: normalised in fp32, back to x's dtype, times the weight. With
    ``use_kernels``, in the C kernel that the block kernel runs (where it can): the same roundings, and the
    same fp32 sum of squares, so the per-op and block paths agree to the bit in bf16 too (a sum taken in
    another order now and then rounds one bf16 value the other way, and a decode step amplifies that). That
    kernel is called as ``torch.ops.dsv3.rms_norm``, which a compiled step traces (``StaticDecode`` on the
    CPU); without the C build the op runs these same three calls."""
    if use_kernels and _norm_ok(norm, x.dtype) and x.device.type == "cpu":
        return torch.ops.dsv3.rms_norm(x, norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(x.dtype)


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """apply_rope as one complex multiply: interleaved pairs of x [B, T, H, R] times rot [B|1, T, 1, R/2]
    (cos + i sin), in fp32 (the result stays fp32)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2)


class AttentionPlan:
    """One MLA layer's decode weights: the kernels' views of its projections and W_UK/W_UV per head.

    The attention runs in fp32 (the cache read in its own dtype), except for a bf16 model over a bf16 cache
    on a CPU with AVX512-BF16, where it takes bf16 dot products (``decode_kernels.bf16_dots``).
    W_UK/W_UV are views of ``kv_b_proj``'s own fp32 or bf16 weight, which the kernel reads in place (bf16
    converted exactly, so the numbers are those of an fp32 copy at half the bytes per step); FP8 blocks
    are dequantized once into a copy of the compute dtype, any other dtype into an fp32 copy."""

    def __init__(self, mla: MLA, dtype: torch.dtype):
        self.mla = mla
        names = ("q_a_proj", "q_b_proj") if hasattr(mla, "q_a_proj") else ("q_proj",)
        self.q = [weight_of(getattr(mla, n)) for n in names]
        self.kv_a, self.o = weight_of(mla.kv_a_proj_with_mqa), weight_of(mla.o_proj)
        kv_b = weight_of(mla.kv_b_proj)
        self.ok = None not in (*self.q, self.kv_a, self.o, kv_b) and not mla._forward_hooks
        if self.ok:  # kv_b_proj is used as per-head matrices, not as a GEMV
            w = kv_b.dense()
            w = (w if w.dtype in dk.A_KIND else w.float()).view(mla.n_heads, mla.nope + mla.v_dim, mla.kv_rank)
            self.w_uk, self.w_uv = w[:, : mla.nope], w[:, mla.nope :]  # [H, nope, r], [H, v, r]

    def __call__(self, x: torch.Tensor, rot: torch.Tensor, cos_sin, cache: LatentCache, start_pos: int,
                 bias: torch.Tensor | None, use_kernels: bool) -> torch.Tensor:
        """MLA.forward on the absorbed path for x [B, T, D]; ``rot`` = cos + i sin [B|1, T, 1, rope/2] and
        ``cos_sin`` the same as two fp32 tensors; ``bias`` [B|1, T, S] or None (no mask)."""
        m = self.mla
        B, T, _ = x.shape
        q, c_kv, k_pe = self.project(x, rot, use_kernels)
        cache.write(m.layer_idx, start_pos, c_kv, k_pe)
        S, layer = start_pos + T, m.layer_idx
        if cache.table is None:
            kv, pe, pages = cache.kv[layer, :B, :S], cache.pe[layer, :B, :S], {}
        else:  # the layer's pages, read in place through the table
            kv, pe, pages = cache.kv[layer], cache.pe[layer], {"table": cache.table, "shift": cache.shift, "slots": S}
        return self.attend(q, *cos_sin, kv, pe, bias, use_kernels, **pages)

    def project(self, x: torch.Tensor, rot: torch.Tensor,
                use_kernels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of x [B, T, D] before the cache: the queries q [B, T, H, nope + rope] and the step's
        latents, c_kv [B, T, r] normed and k_pe [B, T, rope] rotated (fp32), for the caller to store where its
        cache keeps them (``LatentCache.write`` here, the pages in place in ``StaticDecode``)."""
        m = self.mla
        B, T, _ = x.shape
        if len(self.q) == 2:
            q_a = linear(x, self.q[0], use_kernels)
            q = linear(rms_norm(m.q_a_layernorm, q_a, use_kernels), self.q[1], use_kernels)
        else:
            q = linear(x, self.q[0], use_kernels)
        c_kv, k_pe = linear(x, self.kv_a, use_kernels).split([m.kv_rank, m.rope], dim=-1)
        return (q.view(B, T, m.n_heads, m.nope + m.rope), rms_norm(m.kv_a_layernorm, c_kv, use_kernels),
                rotate(k_pe.unsqueeze(2), rot)[:, :, 0])

    def attend(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor,
               bias: torch.Tensor | None, use_kernels: bool, table: torch.Tensor | None = None,
               shift: torch.Tensor | None = None, slots: int = 0) -> torch.Tensor:
        """The absorbed attention of queries q [B, T, H, nope + rope] (``project``'s) over the cache's latents,
        then ``o_proj``: [B, T, D]. kv, pe, ``table``, ``shift`` and ``slots`` as ``mla_decode`` reads them (a
        layer's rows [B, S, .], or its pages with their table); cos, sin [B|1, T, rope/2] fp32."""
        m = self.mla
        out = mla_decode(q, cos, sin, self.w_uk, self.w_uv, kv, pe, bias, m.scale, use_kernels, table=table,
                         shift=shift, slots=slots)
        return linear(out, self.o, use_kernels)


class FeedForwardPlan:
    """A dense SwiGLU MLP or a DeepSeekMoE layer as the kernels run it; ``ok`` False: use the module."""

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp
        self.routed = self.shared = None
        if isinstance(mlp, MoE):
            plain = (LocalDispatcher.is_exact(mlp.dispatcher)
                     and not mlp._forward_hooks and not mlp.gate._forward_hooks)
            self.routed = _expert_weights(mlp.experts) if plain else None
            self.shared = _mlp_weights(mlp.shared_experts) if mlp.shared_experts is not None else None
            self.ok = self.routed is not None and (mlp.shared_experts is None or self.shared is not None)
        else:
            self.shared = _mlp_weights(mlp) if type(mlp) is MLP else None
            self.ok = self.shared is not None

    def __call__(self, x: torch.Tensor, use_kernels: bool, count: bool = True) -> torch.Tensor:
        """x [B, T, D] -> the layer's output [B, T, D]: the router, then the routed experts and the shared ones
        (a dense MLP is one shared "expert" of gate 1), added in one rounding as the kernels do. ``count``: give
        the chosen experts to the layer's counters (``MoE.count_routed``); ``StaticDecode`` does not, as on
        its module branch (a counter is Python state, a list of tensors that a compiled step would guard on)."""
        flat = x.reshape(-1, x.shape[-1])
        out = None
        if self.routed is not None:
            idx, weights = route(flat, self.mlp.gate, use_kernels)
            if count:
                self.mlp.count_routed(idx)
            out = _swiglu(flat, idx, weights, self.routed, None, use_kernels)
        if self.shared is not None:
            one, gate = self._everyone(flat.shape[0], flat.device)
            out = _swiglu(flat, one, gate, self.shared, out, use_kernels)
        return out.view(x.shape)

    def _everyone(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of every row to the one dense "expert" with gate 1 (made once per row count; made in the
        graph when compiled: tensors kept on ``self`` would be state the graph guards on and mutates)."""
        if torch.compiler.is_compiling():
            return torch.zeros(rows, 1, dtype=torch.long, device=device), torch.ones(rows, 1, device=device)
        if getattr(self, "_routing", (None,))[0] != (rows, device):
            self._routing = ((rows, device), torch.zeros(rows, 1, dtype=torch.long, device=device),
                             torch.ones(rows, 1, device=device))
        return self._routing[1], self._routing[2]


def _swiglu(x, idx, gates, experts: ExpertWeights | IntExpertWeights, add_to, use_kernels: bool) -> torch.Tensor:
    """The experts' op for their weights: integer groups (``--weights int8|int4``) or the kernels' own kinds."""
    if isinstance(experts, IntExpertWeights):
        return experts.swiglu(x, idx, gates, add_to, use_kernels)
    return swiglu_experts(x, idx, gates, experts, add_to=add_to, use_kernel=use_kernels)


def _block_experts(experts: ExpertWeights | IntExpertWeights) -> dict | None:
    """The block kernel's view of the experts (integer groups included), or None when it cannot read them."""
    return experts.block_view() if isinstance(experts, IntExpertWeights) else dk.block_experts(experts)


def _expert_weights(experts: nn.Module) -> ExpertWeights | IntExpertWeights | None:
    if experts._forward_hooks or experts._forward_pre_hooks:
        return None
    if type(experts) is IntExperts:
        return experts.kernel_weights()
    if type(experts) is GroupedExperts:
        return ExpertWeights(*(Weight(p.detach()) for p in (experts.gate_proj, experts.up_proj, experts.down_proj)))
    if type(experts) is ResidentFP8Experts:
        stacks = (experts.gate_proj, experts.up_proj, experts.down_proj)
        return ExpertWeights(*(Weight(s.weight_fp8, s.weight_scale_inv, s.dtype) for s in stacks))
    return None


def _mlp_weights(mlp: MLP) -> ExpertWeights | IntExpertWeights | None:
    """A dense SwiGLU MLP as one expert (views [1, N, K] of its weights)."""
    if mlp._forward_hooks or mlp._forward_pre_hooks:
        return None
    integer = shared_expert_weights(mlp)
    if integer is not None:
        return integer
    parts = [weight_of(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
    if None in parts:
        return None
    return ExpertWeights(*(Weight(w.w.unsqueeze(0), None if w.scale_inv is None else w.scale_inv.unsqueeze(0),
                                  w.dtype) for w in parts))


class ModuleSnapshot:
    """What decode plans depend on besides tensor values (not a parallel layout): which modules a model (or a
    block) is made of (a layer made expert-parallel or quantized after the engine was built swaps some), the
    dispatchers' combine formats, whether any module has a hook (a hooked block runs through its modules) and which
    MoE layers count their routed tokens (``MoE.routed_counters``: such a block's MoE half runs where its
    routing can be counted). Checked before every step, so the check is a few C-level passes: each parent
    module's ``_modules`` against a snapshot of its values, and the truth of every hook dict and counter
    list (no module walk)."""

    def __init__(self, modules: Iterable[nn.Module]):
        modules = list(modules)
        self.parents = [m._modules for m in modules if m._modules]
        self.children = self._children()
        self.hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.hooked = any(self.hook_dicts)
        self.dispatchers = [m for m in modules if isinstance(m, TokenDispatcher)]
        self.formats = self._formats()
        self.moes = [m for m in modules if isinstance(m, MoE)]
        self.counting = self._counting()

    def _children(self) -> list[nn.Module]:
        return list(chain.from_iterable(map(dict.values, self.parents)))

    def _formats(self) -> list:
        return list(map(_combine_format, self.dispatchers))

    def _counting(self) -> list[tuple[int, ...]]:
        """Each MoE layer's counters, by identity (a counter replaced by another needs a new plan)."""
        return [tuple(map(id, m.routed_counters)) for m in self.moes]

    def holds(self) -> bool:
        """Whether the modules are still as they were when this snapshot was taken."""
        return (any(self.hook_dicts) == self.hooked and self._children() == self.children
                and self._formats() == self.formats and self._counting() == self.counting)


def _combine_format(dispatcher: TokenDispatcher):
    return getattr(dispatcher, "combine_format", None)


class BlockPlan:
    """One block's decode step: through the block kernel (``kernel``, one C call) when it can run it, else
    through the per-op plans (``attn``, ``ffn``), else (``ok`` False) through the block's own modules.

    An MoE layer that counts its routed tokens (``MoE.routed_counters``, a server's expert load) runs in
    the block kernel when its one counter takes counts from kernels (``kernel_tally``): the kernel adds
    the experts it chooses into that counter's tensor. With other counters its block runs the attention
    half in the block kernel (``attention_kernel``) and the MoE half on the per-op plan, which routes in
    Python's sight and calls every counter."""

    def __init__(self, block: Block, dtype: torch.dtype):
        self.block, self.dtype = block, dtype
        self.snapshot = ModuleSnapshot(block.modules())
        self.attn = AttentionPlan(block.self_attn, dtype)
        self.ffn = FeedForwardPlan(block.mlp)
        self.ok = self.attn.ok and self.ffn.ok and not self.snapshot.hooked
        self.tally = kernel_tally(self.ffn.mlp) if any(self.snapshot.counting) else None
        counted = any(self.snapshot.counting) and self.tally is None
        self.kernel = None if counted else BlockKernel.of(self, tally=self.tally)
        self.attention_kernel = BlockKernel.of(self, feed_forward=False) if counted else None

    def current(self) -> BlockPlan:
        """This plan, or a new one when the block's modules changed since it was made."""
        return self if self.snapshot.holds() else BlockPlan(self.block, self.dtype)

    def __call__(self, x, rot, cos_sin, cache, start_pos, bias, use_kernels):
        """The per-op path: x [B, T, D] -> the block's output."""
        b = self.block
        h = rms_norm(b.input_layernorm, x, use_kernels)
        x = x + self.attn(h, rot, cos_sin, cache, start_pos, bias, use_kernels)
        return self.feed_forward_half(x, use_kernels)

    def feed_forward_half(self, x: torch.Tensor, use_kernels: bool) -> torch.Tensor:
        """x + ffn(norm(x)): the block's second residual branch on the per-op path."""
        return x + self.ffn(rms_norm(self.block.post_attention_layernorm, x, use_kernels), use_kernels)


def kernel_tally(mlp: nn.Module) -> torch.Tensor | None:
    """The tensor the block kernel adds an MoE layer's chosen experts into (int64 [n_experts], on the CPU):
    the ``kernel_counts`` of the layer's counter when it has exactly one and that one takes counts from
    kernels (``MoE.routed_counters``); None otherwise (the layer is then counted in Python's sight)."""
    counters = getattr(mlp, "routed_counters", [])
    tally = getattr(counters[0], "kernel_counts", None) if len(counters) == 1 else None
    ok = (isinstance(tally, torch.Tensor) and tally.dtype == torch.long and tally.device.type == "cpu"
          and tally.is_contiguous() and tally.shape == (mlp.n_experts,))
    return tally if ok else None


def _norm_ok(norm: RMSNorm, dtype: torch.dtype) -> bool:
    w = norm.weight
    return type(norm) is RMSNorm and w.dtype == dtype and w.is_contiguous() and w.device.type == "cpu"


class BlockKernel:
    """A block's plan as one ``dsv3_decode_block`` call: the descriptor (pointers into the block's own
    tensors, made once) and those tensors, held so that the pointers stay valid even if the module's
    parameters are replaced later (``.to()`` swaps ``param.data``)."""

    def __init__(self, desc: dk.Descriptor, keep: list):
        self.desc, self.keep = desc, keep
        self.address = desc.address
        self.layer = desc.fields["layer"]  # the cache layer it writes: a step's cache must have it

    @classmethod
    def of(cls, plan: BlockPlan, feed_forward: bool = True, tally: torch.Tensor | None = None) -> BlockKernel | None:
        """The plan's block kernel, or None when the C kernels are not built or cannot read one of its
        tensors (that block then runs the per-op path). ``feed_forward=False``: the attention half alone,
        x + attn(norm(x)), for a block whose MoE half runs on the per-op path (see ``BlockPlan``).
        ``tally``: int64 [n_experts] that every step adds the chosen experts into (``kernel_tally``)."""
        if not plan.ok or plan.dtype not in dk.A_KIND or not dk.block_kernel_available():
            return None
        b, a, f = plan.block, plan.attn, plan.ffn
        m = b.self_attn
        norms = [b.input_layernorm, b.post_attention_layernorm, m.kv_a_layernorm]
        norms += [m.q_a_layernorm] if len(a.q) == 2 else []
        linears = [dk.block_linear(w) for w in (*a.q, a.kv_a, a.o)]
        w_uk, w_uv = a.w_uk, a.w_uv
        zero = None if feed_forward else _zero_feed_forward(b.input_layernorm.weight.shape[0], plan.dtype)
        if zero is None:
            routed = _block_experts(f.routed) if f.routed is not None else {}
            shared = _block_experts(f.shared) if f.shared is not None else {}
            router = dk.route_constants(f.mlp.gate) if f.routed is not None else ({}, [])
        else:
            routed, shared, router = {}, dk.block_experts(zero), ({}, [])
        if (not all(_norm_ok(n, plan.dtype) for n in norms) or None in linears or routed is None or shared is None
                or router is None or any(w.device.type != "cpu" or w.stride(-1) != 1 for w in (w_uk, w_uv))):
            return None
        tally = tally if zero is None and f.routed is not None else None
        keep = [n.weight.detach() for n in norms] + router[1] + ([] if zero is None else [zero]) + [tally]
        q_a, q_b = linears[:-2] if len(a.q) == 2 else ({}, linears[0])
        desc = dk.Descriptor(
            "block", akind=dk.A_KIND[plan.dtype], dim=b.input_layernorm.weight.shape[0], layer=m.layer_idx,
            input_norm=keep[0].data_ptr(), post_norm=keep[1].data_ptr(), kv_norm=keep[2].data_ptr(),
            q_norm=keep[3].data_ptr() if len(a.q) == 2 else None,
            input_eps=b.input_layernorm.eps, post_eps=b.post_attention_layernorm.eps, kv_eps=m.kv_a_layernorm.eps,
            q_eps=m.q_a_layernorm.eps if len(a.q) == 2 else 0.0,
            q_a=q_a, q_b=q_b, kv_a=linears[-2], o=linears[-1], w_uk=w_uk.data_ptr(), w_uv=w_uv.data_ptr(),
            uk_hstride=w_uk.stride(0), uk_rstride=w_uk.stride(1), uv_hstride=w_uv.stride(0),
            uv_rstride=w_uv.stride(1), w_kind=dk.A_KIND[w_uk.dtype], heads=m.n_heads, nope=m.nope, rope=m.rope,
            v_dim=m.v_dim, kv_rank=m.kv_rank, softmax_scale=m.scale, routed=routed, shared=shared,
            expert_counts=None if tally is None else tally.data_ptr(), **router[0])
        return cls(desc, keep)


def _zero_feed_forward(dim: int, dtype: torch.dtype) -> ExpertWeights:
    """A feed-forward that adds exactly zero: one SwiGLU expert of inner size 1 whose weights are all zero
    (silu(0) * 0 times 0). The block kernel always runs a feed-forward half; with this one its result is
    x + attn(norm(x)) to the bit, which is how a block runs its attention half alone without a kernel of
    its own (``BlockKernel.of(..., feed_forward=False)``)."""
    gate_up = torch.zeros(1, 1, dim, dtype=dtype)
    return ExpertWeights(Weight(gate_up), Weight(gate_up), Weight(torch.zeros(1, dim, 1, dtype=dtype)))


class StepKernel:
    """The whole decode step as one ``dsv3_decode_step`` call: the embedding, the block kernels of ``plans`` in
    order, the final norm and the head, when every one of them can run in C."""

    def __init__(self, desc: dk.Descriptor, keep: list):
        self.desc, self.keep = desc, keep
        self.address = desc.address
        self.layers = 1 + max(k.layer for k in keep[0])  # cache layers a step's cache must have

    @classmethod
    def of(cls, plans: list[BlockPlan], model: Transformer, head: Weight | None,
           dtype: torch.dtype) -> StepKernel | None:
        """The step kernel of the model as it is now, or None when a part cannot run in C."""
        embed, norm = model.model.embed_tokens, model.model.norm
        w = embed.weight
        linear_head = dk.block_linear(head) if head is not None else None
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (embed, norm, model.lm_head))
        if (hooked or not plans or any(p.kernel is None for p in plans) or type(embed) is not nn.Embedding
                or embed.max_norm is not None or w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu"
                or not _norm_ok(norm, dtype) or linear_head is None):
            return None
        blocks = torch.tensor([p.kernel.address for p in plans], dtype=torch.int64)  # the blocks' descriptors
        keep = [[p.kernel for p in plans], blocks, w.detach(), norm.weight.detach(), head.w, head.kernel_scale]
        desc = dk.Descriptor("model", akind=dk.A_KIND[dtype], dim=w.shape[1], vocab=w.shape[0], n_blocks=len(plans),
                             embed=w.data_ptr(), blocks=blocks.data_ptr(), norm=norm.weight.data_ptr(),
                             norm_eps=norm.eps, head=linear_head)
        return cls(desc, keep)


class RopeTable:
    """cos and sin of every position up to the longest cache seen, made by ``model.angles`` once: a decode
    step looks its rows up instead of computing them (seven PyTorch calls a step). Rows equal what
    ``model.angles`` gives one position (elementwise math; ``tests/infer/test_decode_fast.py`` checks it)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.cos = self.sin = torch.empty(0)

    def tables(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rope/2] (fp32, contiguous) of positions [0, n) for some n >= size, on ``device``: the same
        tensors from call to call until a larger size or another device makes new ones."""
        if self.cos.shape[0] < size or self.cos.device != device:
            n = max(size, 2 * self.cos.shape[0])
            self.cos, self.sin = self.model.angles(torch.arange(n, device=device))
        return self.cos, self.sin

    def __call__(self, positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, rope/2] (fp32, contiguous) for positions below ``size`` (larger ones
        are computed directly)."""
        self.tables(size, positions.device)
        try:
            return self.cos[positions], self.sin[positions]
        except IndexError:  # a position past the cache (not one the engine makes)
            return tuple(t.contiguous() for t in self.model.angles(positions))


class Step:
    """What every block of one decode step shares: the RoPE rotation (as cos/sin, and as cos + i sin for
    the per-op path, each made on first use), the additive mask bias, and the kernels' step descriptor
    (``kernel``, set by ``FastDecode``; None when this step cannot use it: too many rows, a cache of another
    kind, a full cache)."""

    def __init__(self, rope: RopeTable, positions: torch.Tensor, T: int, start_pos: int,
                 mask: torch.Tensor | None, cache: LatentCache):
        self.rope, self.positions, self.T = rope, positions, T
        self.mask, self.start_pos, self.cache = mask, start_pos, cache
        self.max_len = cache.max_len  # once a step: a paged cache computes it from its table (a few tensor ops)
        self.bias = self._bias(positions.device, T, start_pos, mask)
        self._rot = self._cos_sin = None
        self.kernel: dk.Descriptor | None = None

    @property
    def address(self) -> int:
        return self.kernel.address

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, rope/2] fp32 (the per-op and module paths' rotation)."""
        if self._cos_sin is None:
            self._cos_sin = self.rope(self.positions, self.max_len)
        return self._cos_sin

    def with_rope_rows(self) -> None:
        """Give the kernels' descriptor the RoPE rows themselves (for positions its table lacks)."""
        c = self.cache
        self.kernel = dk.block_step(self.kernel.fields["rows"], self.T, self.start_pos, *self.cos_sin, c.kv, c.pe,
                                    self.bias, c.table, c.shift)

    @staticmethod
    def _bias(device, T: int, start_pos: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The additive mask bias [B|1, T, S] (None when every query sees every key so far)."""
        if mask is None and T == 1:
            return None
        S = start_pos + T
        slots = torch.arange(S, device=device)
        keep = slots[None, :] <= slots[start_pos:, None]  # [T, S] causal
        keep = keep[None] if mask is None else keep[None] & mask
        return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, float("-inf"))

    @staticmethod
    def kernel_fits(cache: LatentCache, rows: int, T: int, dtype: torch.dtype) -> bool:
        """Whether the kernels can run steps of ``rows`` x ``T`` tokens over this cache (while it has room): a
        plain one, or a paged one whose table and shift they read (``LatentCache.paged`` makes them so)."""
        kv, pe, table, shift = cache.kv, cache.pe, cache.table, cache.shift
        pages = (kv.shape[:3] == pe.shape[:3] and table.dtype == torch.int32 and table.device.type == "cpu"
                 and table.stride(1) == 1 and table.shape[1] > 0 and shift.dtype == torch.int64
                 and shift.device.type == "cpu" and shift.is_contiguous()) if table is not None else (
                     rows <= pe.shape[1])
        return (dtype in dk.A_KIND and rows * T <= dk.MAX_KERNEL_ROWS and kv.dtype in dk.A_KIND
                and pe.dtype == kv.dtype and kv.device.type == "cpu" and pe.device.type == "cpu"
                and kv.stride(-1) == 1 and pe.stride(-1) == 1 and rows <= cache.rows and pages
                and kv.shape[0] == pe.shape[0])

    @property
    def rot(self) -> torch.Tensor:
        """cos + i sin [B|1, T, 1, R/2] (the per-op path's rotation)."""
        if self._rot is None:
            self._rot = torch.complex(*self.cos_sin).unsqueeze(-2)
        return self._rot


class FastDecode:
    """The decode-step interface of a :class:`Transformer` (``hidden_states``, ``lm_head``, ``mtp_hidden``,
    ``mtp_logits``, same signatures) computed with few, large operations. Prefill (``start_pos == 0``) and
    calls without a cache go to the model itself, unless ``absorb=True`` asks for the absorbed path: a
    prompt's chunk does (``dsv3.infer.chunked_prefill``; the first one starts at 0), as the absorbed path is
    exact over any cache. The plans hold the model's own tensors, so build this after the model's final form
    (dtype, FP8 weights) is set.

    ``hidden_and_logits`` runs the whole step in one C call (``StepKernel``) when every part can;
    otherwise each block runs in one C call (``BlockKernel``) when it can, else through the per-op path,
    else through its modules. ``step_kernel=False`` and ``block_kernel=False`` stop at the layer below
    (the tests compare each layer with the one below it)."""

    def __init__(self, model: Transformer, use_kernels: bool = True, block_kernel: bool = True,
                 step_kernel: bool = True):
        self.model = model
        self.use_kernels = use_kernels
        self.block_kernel = block_kernel and use_kernels
        self.step_kernel = step_kernel and self.block_kernel
        self.dtype = model.model.embed_tokens.weight.dtype
        self.kernels = kernel_status() if use_kernels else "not asked for"  # builds them now, not mid-request
        self.blocks = [BlockPlan(layer, self.dtype) for layer in model.model.layers]
        self.head = weight_of(model.lm_head)
        self.rope = RopeTable(model)
        self._eh: dict[int, tuple[nn.Module, Weight | None]] = {}
        self._step_kernel: StepKernel | None = None
        self._snapshot: ModuleSnapshot | None = None  # of the whole model, when the step kernel was made
        # per (rows, T, threads): the cache tensors and RoPE table a reusable step descriptor points into
        self._table_steps: dict[tuple, tuple] = {}
        self._scanned: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, their scan) of the last step

    def _usable(self, cache: LatentCache | None, start_pos: int, absorb: bool | None) -> bool:
        return cache is not None and (absorb is True or (start_pos > 0 and absorb is None))

    def _plan(self, i: int) -> BlockPlan:
        self.blocks[i] = self.blocks[i].current()
        return self.blocks[i]

    def _step(self, positions: torch.Tensor, T: int, start_pos: int, mask, cache: LatentCache, rows: int) -> Step:
        step = Step(self.rope, positions, T, start_pos, mask, cache)
        if self.block_kernel and start_pos + T <= step.max_len and dk.block_kernel_available():
            step.kernel = self._kernel_step(step, rows)
        return step

    def _kernel_step(self, step: Step, rows: int) -> dk.Descriptor | None:
        """The kernels' descriptor of ``step`` (None when they cannot run it): the descriptor made for this
        cache, row count and RoPE table, pointed at this step's slot and positions (which the kernels look
        up in the table), or, for positions of another form, one with the RoPE rows themselves."""
        cache, positions, T = step.cache, step.positions, step.T
        if not (positions.dtype == torch.long and positions.dim() == 2 and positions.shape[0] in (1, rows)
                and positions.shape[1] == T and positions.is_contiguous() and positions.device.type == "cpu"):
            if not Step.kernel_fits(cache, rows, T, self.dtype):
                return None
            return dk.block_step(rows, T, step.start_pos, *step.cos_sin, cache.kv, cache.pe, step.bias, cache.table,
                                 cache.shift)
        cos, sin = self.rope.tables(step.max_len, positions.device)
        key = (rows, T, torch.get_num_threads())
        made = self._table_steps.get(key)
        if made is None or made[0] is not cache.kv or made[1] is not cache.pe or made[2] is not cos:
            if not Step.kernel_fits(cache, rows, T, self.dtype):
                return None
            made = self._table_steps[key] = (cache.kv, cache.pe, cos, dk.table_step(rows, T, cos, sin, cache.kv,
                                                                                      cache.pe))
        if cache.table is not None and not Step.kernel_fits(cache, rows, T, self.dtype):
            return None  # the pool fits, this step's table may not (the descriptor is re-pointed at each)
        return dk.retarget(made[3], step.start_pos, positions, step.bias, cache.table, cache.shift)

    def _run(self, plan: BlockPlan, x: torch.Tensor, step: Step) -> torch.Tensor:
        """One block: the block kernel (in place on x), the attention kernel then the per-op MoE half, the
        per-op path, or the block's modules."""
        kernel = plan.kernel or plan.attention_kernel
        if (step.kernel is not None and kernel is not None and kernel.layer < step.cache.kv.shape[0]
                and x.dtype == plan.dtype and x.is_contiguous()):
            if not dk.decode_block(kernel.address, step.address, x):
                step.with_rope_rows()
                dk.decode_block(kernel.address, step.address, x)
            return x if kernel is plan.kernel else plan.feed_forward_half(x, self.use_kernels)
        if plan.ok:
            return plan(x, step.rot, step.cos_sin, step.cache, step.start_pos, step.bias, self.use_kernels)
        return plan.block(x, *step.cos_sin, step.cache, step.start_pos, step.mask, True)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """rms_norm, in one C call when the kernels run (as every block's norms)."""
        return rms_norm(norm, x, self.use_kernels)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: LatentCache | None = None, start_pos: int = 0,
                      mask: torch.Tensor | None = None, absorb: bool | None = None) -> torch.Tensor:
        """Transformer.hidden_states for a decode step."""
        if not self._usable(cache, start_pos, absorb):
            return self.model.hidden_states(input_ids, positions, cache, start_pos, mask, absorb)
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)[None]
        return self._hidden(input_ids, self._step(positions, T, start_pos, mask, cache, B))

    def _hidden(self, input_ids: torch.Tensor, step: Step, planned: bool = False) -> torch.Tensor:
        """The final-normed hidden states of ``step``, block by block (``_run``). ``planned``: the whole
        model's layout was checked this step (``_whole_step``), so every block's plan is current."""
        x = self.model.model.embed_tokens(input_ids)
        for i in range(self.model.config.num_hidden_layers):
            x = self._run(self.blocks[i] if planned else self._plan(i), x, step)
        return self._norm(self.model.model.norm, x)

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                          cache: LatentCache | None = None, start_pos: int = 0, mask: torch.Tensor | None = None,
                          absorb: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Transformer.hidden_and_logits for a decode step: in one C call (``StepKernel``) when every part
        can run there, else ``hidden_states`` then ``lm_head``."""
        if self._usable(cache, start_pos, absorb) and input_ids.device.type == "cpu":
            B, T = input_ids.shape
            if positions is None:
                positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)[None]
            step = self._step(positions, T, start_pos, mask, cache, B)
            kernel = self._whole_step(step)
            if kernel is not None:
                h = torch.empty(B, T, kernel.desc.fields["dim"], dtype=self.dtype)
                logits = torch.empty(B, T, kernel.desc.fields["head"]["n"], dtype=self.dtype)
                scan = torch.empty(B * T, dtype=torch.long)
                ids = input_ids.long().contiguous()
                if not dk.decode_step(kernel.address, step.address, ids, h, logits, scan):
                    step.with_rope_rows()
                    dk.decode_step(kernel.address, step.address, ids, h, logits, scan)
                self._scanned = (logits, scan)
                return h, logits
            # block by block, on the step already set up (and planned, when _whole_step checked the layout)
            h = self._hidden(input_ids, step, planned=step.kernel is not None and self.step_kernel)
        else:
            h = self.hidden_states(input_ids, positions, cache, start_pos, mask, absorb)
        return h, self.lm_head(h)

    def _whole_step(self, step: Step) -> StepKernel | None:
        """The step kernel for the model as it is now, or None when this step or a part cannot use it. One
        check of the whole model's module snapshot per step; the blocks are planned again only when it changed."""
        if step.kernel is None or not self.step_kernel:
            return None
        if self._snapshot is None or not self._snapshot.holds():
            self._snapshot = ModuleSnapshot(self.model.modules())
            plans = [self._plan(i) for i in range(self.model.config.num_hidden_layers)]
            self._step_kernel = StepKernel.of(plans, self.model, self.head, self.dtype)
        kernel = self._step_kernel
        return kernel if kernel is not None and kernel.layers <= step.cache.kv.shape[0] else None

    def scan_logits(self, logits: torch.Tensor) -> list[int] | None:
        """``decode_kernels.scan_logits`` of logits [..., V]: read from the step kernel's own scan when these
        are the logits its last call wrote (the same numbers, without a second call after the step)."""
        scanned, self._scanned = self._scanned, None
        if scanned is not None and scanned[0] is logits:
            return scanned[1].tolist()
        return dk.scan_logits(logits)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return self.model.lm_head(h)
        return linear(h, self.head, self.use_kernels)

    def _eh_proj(self, depth: int, layer: MTPLayer) -> Weight | None:
        """The kernels' view of an MTP layer's eh_proj (made once per module)."""
        if self._eh.get(depth, (None,))[0] is not layer.eh_proj:
            self._eh[depth] = (layer.eh_proj, weight_of(layer.eh_proj))
        return self._eh[depth][1]

    def mtp_hidden(self, depth: int, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   cache: LatentCache | None = None, start_pos: int = 0, mask=None, absorb=None) -> torch.Tensor:
        """Transformer.mtp_hidden for a decode step."""
        layer: MTPLayer = self.model.mtp_layers[depth]
        plan = self._plan(self.model.config.num_hidden_layers + depth)
        eh = self._eh_proj(depth, layer)
        if (not self._usable(cache, start_pos, absorb) or eh is None or not plan.ok or layer._forward_hooks
                or layer._forward_pre_hooks):
            return self.model.mtp_hidden(depth, h, next_ids, positions, cache, start_pos, mask, absorb)
        B, T = next_ids.shape
        step = self._step(positions, T, start_pos, mask, cache, B)
        emb = getattr(layer, "embed_tokens", self.model.model.embed_tokens)(next_ids)
        x = linear(torch.cat([self._norm(layer.enorm, emb), self._norm(layer.hnorm, h)], dim=-1), eh, self.use_kernels)
        return self._run(plan, x.contiguous(), step)

    def mtp_logits(self, depth: int, h_mtp: torch.Tensor, vocab=None) -> torch.Tensor:
        """Transformer.mtp_logits; with ``vocab`` (a ``dsv3.infer.draft_vocab.DraftVocab``) the logits of its
        K tokens only [..., K], from its gathered copy of the head's rows (the full head then those columns
        when the head cannot be gathered)."""
        # the layer by one index: ``Transformer.mtp_layers`` slices the ModuleList (about 0.1 ms a call)
        shared = self.model.model.layers[self.model.config.num_hidden_layers + depth].shared_head
        head = getattr(shared, "head", self.model.lm_head)  # Transformer._mtp_head
        normed = self._norm(shared.norm, h_mtp)
        w = self.head if head is self.model.lm_head else weight_of(head)
        if vocab is not None:
            rows = vocab.head_weight(w)  # None only for a head the kernels cannot read (w None)
            return vocab.restrict(head(normed)) if rows is None else linear(normed, rows, self.use_kernels)
        return head(normed) if w is None else linear(normed, w, self.use_kernels)
