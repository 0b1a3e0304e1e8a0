"""The fast decode path (kernels/decode.py, kernels/decode_kernels.*) against the readable one: each C kernel
against its PyTorch reference, and whole decode steps (logits, greedy tokens) against the modules, for
fp32, bf16 and FP8 weights, batch 1 and ragged batches, with and without MTP speculation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.fp8_weights import to_fp8_weights
from dsv3.infer.metrics import RouterCounts
from dsv3.kernels import decode_kernels as dk
from dsv3.kernels.decode import FastDecode, Step
from dsv3.kernels.int_weights import to_int_weights
from dsv3.precision.fp8 import quantize_weight_blocks
from dsv3.testing.ragged import decode_ragged, ragged_mask

sys.path.insert(0, str(Path(__file__).parent))
from conftest import decisive_routing, tiny_model  # noqa: E402

needs_kernels = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")
PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 2, 9, 8]]


def weights(kind: str, n: int, k: int, lead: tuple[int, ...] = (), seed: int = 0) -> dk.Weight:
    w = torch.randn(*lead, n, k, generator=torch.Generator().manual_seed(seed))
    if kind == "fp8":
        if lead:
            pairs = [quantize_weight_blocks(m) for m in w.flatten(0, -3)]
            return dk.Weight(torch.stack([q for q, _ in pairs]).view(*lead, n, k),
                             torch.stack([s for _, s in pairs]).view(*lead, *pairs[0][1].shape), torch.float32)
        return dk.Weight(*quantize_weight_blocks(w), torch.float32)
    return dk.Weight(w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind]))


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Relative error (norm) within the rounding of ``dtype``'s inputs and outputs."""
    err = (got.float() - ref.float()).norm() / ref.float().norm()
    return bool(err < (1e-2 if dtype == torch.bfloat16 else 1e-5))


@needs_kernels
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6, 17])
def test_linear_kernel_equals_reference(kind, act, rows):
    w = weights(kind, 130, 200)  # partial 128-blocks, a tail under 8 columns
    x = torch.randn(rows, 200).to(act)
    ref = (x.float() @ w.dense().float().t()).to(act)  # the reference without rounding the weight to ``act``
    assert close(dk.linear(x, w), ref, act)
    assert close(dk.linear(x, w, use_kernel=False), ref, act)


@needs_kernels
def test_fp8_kernel_reads_every_e4m3_value_exactly():
    """All 254 finite e4m3 codes (subnormals and negative zero included) times a one-hot row pick each
    weight out exactly: the in-register conversion is the dequantization, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    w = finite[:, None].expand(-1, 128).contiguous()  # [254, 128], one code per row
    w = dk.Weight(w, torch.full((2, 1), 0.5), torch.float32)
    x = torch.zeros(1, 128)
    x[0, 5] = 1.0
    assert torch.equal(dk.linear(x, w)[0], finite.float() * 0.5)


@needs_kernels
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 5])
def test_swiglu_experts_kernel_equals_reference(kind, rows):
    E, I, D = 6, 136, 144
    experts = dk.ExpertWeights(weights(kind, I, D, (E,), 1), weights(kind, I, D, (E,), 2), weights(kind, D, I, (E,), 3))
    x = torch.randn(rows, D) / 4
    idx = torch.stack([torch.randperm(E)[:3] for _ in range(rows)])  # rows share experts
    gates = torch.rand(rows, 3)
    ref = dk.swiglu_experts_reference(x, idx, gates, experts)
    assert torch.allclose(dk.swiglu_experts(x, idx, gates, experts), ref, atol=1e-3, rtol=1e-3)
    base = torch.randn(rows, D)
    assert torch.allclose(dk.swiglu_experts(x, idx, gates, experts, add_to=base.clone()), base + ref, atol=1e-3,
                          rtol=1e-3)


HAS_BF16_DOTS = dk.kernels_available() and dk.bf16_dots()


def bf16_dots_on(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether mla_decode takes the AVX512-BF16 path for these queries and this cache."""
    return q.dtype == kv.dtype == torch.bfloat16 and dk.bf16_dots()


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("S", [37, 200])
def test_mla_decode_kernel_equals_reference(cache_dtype, T, S, bf16_path):
    """Within one tile of keys (37) and over several (200: the kernel's online softmax, with a whole
    tile masked for one row and the largest scores late, so the running max grows). The bf16 dot products
    against the reference with the queries rounded as they round them (against plain fp32 their error is
    that rounding's: up to 2e-2 on these peaked scores, 5e-3 typically; the module path's bf16 matmuls,
    which also round the scores, err more)."""
    torch.manual_seed(0)
    B, H, nope, r, p, v = 3, 6, 16, 24, 8, 12
    q = torch.randn(B, T, H, nope + p).to(cache_dtype)
    angles = torch.rand(B, T, p // 2) * 6
    w = torch.randn(H, nope + v, r)  # kv_b_proj's weight per head: W_UK then W_UV, as views
    cache_kv, cache_pe = torch.randn(B, S + 13, r), torch.randn(B, S + 13, p)
    cache_kv[:, S // 2 :] *= 3  # later keys score higher
    cache_kv, cache_pe = cache_kv.to(cache_dtype), cache_pe.to(cache_dtype)
    kv, pe = cache_kv[:, :S], cache_pe[:, :S]  # views with the cache's row strides
    keep = torch.rand(B, T, S) > 0.3
    keep[1, :, :100] = False  # row 1 sees nothing in its first tile(s)
    keep[:, :, -1] = True
    bias = torch.zeros(B, T, S).masked_fill_(~keep, float("-inf"))
    for b, rot in ((None, angles), (bias, angles), (bias[:1], angles[:1])):
        args = (q, rot.cos(), rot.sin(), w[:, :nope], w[:, nope:], kv, pe, b, 0.3)
        ref = dk.mla_decode_reference(*args, bf16_queries=bf16_dots_on(q, kv))
        assert close(dk.mla_decode(*args), ref, cache_dtype)


def step_logits(model, decoder, prompt, steps=4, T=1, cache_dtype=None):
    """Teacher-forced absorbed decode steps after a prefill: logits [steps, T, V] through ``decoder``."""
    cache = model.new_cache(1, len(prompt) + steps * T + 2, dtype=cache_dtype)
    out = []
    with torch.inference_mode():
        model(torch.tensor([prompt]), cache=cache)
        pos = len(prompt)
        for s in range(steps):
            ids = torch.tensor([[(7 * s + 3 + t) % 300 for t in range(T)]])
            out.append(decoder.hidden_and_logits(ids, cache=cache, start_pos=pos)[1][0])
            pos += T
    return torch.stack(out)


def model_in(precision: str, against_modules: bool = False):
    """fp32, bf16, FP8 weights or integer experts (int8, int4: ``--weights int8|int4``) computed in bf16
    ("fp8", "int8", "int4") or in fp32 ("fp8-fp32", "int8-fp32", "int4-fp32": the dequantized weights are
    then exact, so the fast path must match the module path to fp32 rounding).
    ``against_modules``: compared logit for logit with the module path, so a bf16 model routes by
    ``decisive_routing`` (near-tied expert scores would otherwise part the two bf16 paths' choices)."""
    model = tiny_model()
    if precision in ("bf16", "fp8", "int8", "int4"):
        model = model.to(torch.bfloat16)
        if against_modules:
            decisive_routing(model)
    if precision.startswith("int"):
        return to_int_weights(model, int(precision[3]))
    return to_fp8_weights(model) if precision.startswith("fp8") else model


MODES = {"step kernel": {}, "block kernel": {"step_kernel": False}, "per-op kernels": {"block_kernel": False},
         "per-op torch": {"use_kernels": False}}


def decoder_in(model, mode: str) -> FastDecode:
    """FastDecode in one of its four modes; the kernel modes really run every block in one call (and the step
    kernel mode, checked by ``ran_the_step_kernel``, the whole step)."""
    fast = FastDecode(model, **MODES[mode])
    if mode in ("step kernel", "block kernel") and dk.kernels_available():
        assert all(plan.kernel is not None for plan in fast.blocks)
    else:
        assert all(plan.kernel is None for plan in fast.blocks) or fast.block_kernel is False
    return fast


def ran_the_step_kernel(fast: FastDecode) -> bool:
    return fast._step_kernel is not None or not dk.kernels_available()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "fp8-fp32", "int8", "int4", "int8-fp32", "int4-fp32"])
@pytest.mark.parametrize("T", [1, 2])
def test_fast_decode_logits_equal_the_module_path(precision, T):
    """FP8 weights and integer experts: equal to the model whose weights are dequantized for every matmul
    (the module path), exactly up to fp32 rounding when computing in fp32 (integer layers: up to
    activation_rounding), within bf16 rounding in bf16."""
    model = model_in(precision, against_modules=True)
    ref = step_logits(model, model, PROMPTS[2], T=T).float()
    scale = ref.abs().max()
    limit = 3e-2 if precision in ("bf16", "fp8", "int8", "int4") else activation_rounding(precision) or 2e-6
    for mode in MODES:
        fast = decoder_in(model, mode)
        got = step_logits(model, fast, PROMPTS[2], T=T).float()
        assert (got - ref).abs().max() / scale < limit, mode
        assert mode != "step kernel" or ran_the_step_kernel(fast)


def activation_rounding(precision: str) -> float:
    """How far fp32 logits may part here because integer layers round their activations to int8 per group of
    32 (0: they have none). Every path rounds them alike (``round_activations``), but an activation that two
    paths compute apart at fp32 rounding can round a step apart (1/127 of its group's largest), so fp32 paths
    agree to about 1e-5, not 1e-7."""
    return 1e-4 if precision.startswith("int") else 0.0


def same_roundings(block: torch.Tensor, per_op: torch.Tensor, precision: str = "") -> bool:
    """fp32: equal to fp32 rounding (or to activation_rounding's step). bf16: equal to the bit, since both round
    to bf16 at the same places with the same kernels (norms included; a path that rounds elsewhere, like the
    module path, differs in about 80% of the logits)."""
    if block.dtype == torch.float32:
        limit = activation_rounding(precision) or 2e-6
        return bool((block - per_op).abs().max() / per_op.abs().max() < limit)
    return torch.equal(block, per_op)


@needs_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "int8", "int4", "int4-fp32"])
def test_block_kernel_rounds_where_the_per_op_path_does(precision):
    """The block kernel against the per-op path it fuses."""
    model = model_in(precision)
    per_op = step_logits(model, decoder_in(model, "per-op kernels"), PROMPTS[2], T=2)
    assert same_roundings(step_logits(model, decoder_in(model, "block kernel"), PROMPTS[2], T=2), per_op, precision)


@needs_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 2])
def test_step_kernel_equals_the_block_kernels_to_the_bit(precision, T):
    """The whole step in one C call runs the block kernels, the final norm and the head in the same order
    as the block kernel mode does from Python: the same numbers, to the bit, at batch 1 and in a ragged
    batch (and the MTP layer, which runs its block kernel after either)."""
    model = model_in(precision)
    step, block = decoder_in(model, "step kernel"), decoder_in(model, "block kernel")
    assert torch.equal(step_logits(model, step, PROMPTS[2], T=T), step_logits(model, block, PROMPTS[2], T=T))
    for got, ref in zip(ragged_logits(model, step, PROMPTS, T=T), ragged_logits(model, block, PROMPTS, T=T),
                        strict=True):
        assert torch.equal(got, ref)
    assert step._step_kernel is not None and block._step_kernel is None


@needs_kernels
def test_step_kernel_refuses_an_id_outside_the_vocabulary_before_writing():
    """An id the embedding does not have: IndexError, as nn.Embedding raises, and the cache untouched."""
    model = tiny_model()
    fast = FastDecode(model)
    cache = model.new_cache(2, 16)
    with torch.inference_mode():
        model(torch.tensor([PROMPTS[0], PROMPTS[0]]), cache=cache)
        before = cache.kv.clone(), cache.pe.clone()
        for bad in (model.config.vocab_size, -1):
            with pytest.raises(IndexError):
                fast.hidden_and_logits(torch.tensor([[3], [bad]]), cache=cache, start_pos=len(PROMPTS[0]))
    assert torch.equal(cache.kv, before[0]) and torch.equal(cache.pe, before[1])
    assert fast._step_kernel is not None


@needs_kernels
@pytest.mark.parametrize("mode", ["step kernel", "block kernel"])
def test_kernels_follow_positions_past_their_rope_table_and_a_change_of_cache(mode, monkeypatch):
    """The kernels look each step's RoPE rows up in a table of the positions a cache can hold, through a
    descriptor made once per cache: a position past the table (a caller's own positions) falls back to
    rows computed for it, and two caches decoded in turn each get their own descriptor. Logits equal the
    module path's."""
    model = tiny_model()
    fast = decoder_in(model, mode)
    fallbacks = []
    with_rows = Step.with_rope_rows
    monkeypatch.setattr(Step, "with_rope_rows", lambda step: fallbacks.append(step) or with_rows(step))
    prompts = (PROMPTS[0], PROMPTS[2])
    caches = {which: (model.new_cache(1, 32), model.new_cache(1, 32)) for which in ("fast", "module")}
    with torch.inference_mode():
        for which in caches:
            for prompt, cache in zip(prompts, caches[which], strict=True):
                model(torch.tensor([prompt]), cache=cache)
        for step in range(3):
            for i, prompt in enumerate(prompts):
                start = len(prompt) + step
                far = step == 1 and i == 0  # a position far past any table the caches need
                positions = torch.tensor([[5000 + step if far else start]])
                ids = torch.tensor([[(11 * step + 5 * i) % 300]])
                got = fast.hidden_and_logits(ids, positions=positions, cache=caches["fast"][i], start_pos=start)[1]
                ref = model.hidden_and_logits(ids, positions=positions, cache=caches["module"][i], start_pos=start)[1]
                assert (got - ref).abs().max() / ref.abs().max() < 2e-6, (step, i)
    assert len(fallbacks) == 1
    assert mode != "step kernel" or ran_the_step_kernel(fast)


def ragged_logits(model, decoder, prompts, steps: int = 3, T: int = 1):
    """A ragged batch decoded as the engine does (left padding, per-row positions, a mask with a hole
    where row 0's second token was rejected), teacher-forced through ``decoder``: the main logits
    [steps, B, T, V] and the MTP layer's [steps, B, T, V]."""
    B, L = len(prompts), max(len(p) for p in prompts)
    cache = model.new_cache(B, L + steps * T + 2)
    pads = torch.tensor([L - len(p) for p in prompts])
    valid = torch.zeros(B, cache.max_len, dtype=torch.bool)
    valid[:, :L] = torch.arange(L)[None] >= pads[:, None]
    with torch.inference_mode():
        ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
        model.hidden_states(ids, positions=(torch.arange(L)[None] - pads[:, None]).clamp(min=0), cache=cache,
                            mask=ragged_mask(valid, 0, L))
    main, mtp = decode_ragged(decoder, cache, valid, L, pads, steps, T)
    return main.float(), mtp.float()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8-fp32"])
@pytest.mark.parametrize("T", [1, 2])
def test_ragged_batches_and_the_mtp_layer_equal_the_module_path(precision, T, bf16_path):
    """Batch 3 with left padding, a hole in the mask, T = 1 and 2 (MTP verify), and the MTP layer's
    drafts: every mode of the fast path against the modules."""
    model = model_in(precision, against_modules=True)
    ref = ragged_logits(model, model, PROMPTS, T=T)
    limit = 3e-2 if precision == "bf16" else 2e-6
    for mode in MODES:
        got = ragged_logits(model, decoder_in(model, mode), PROMPTS, T=T)
        for g, r in zip(got, ref, strict=True):
            assert (g - r).abs().max() / r.abs().max() < limit, mode


class PythonCounter:
    """A routed-token counter that only Python code can call (no ``kernel_counts``): counts [n_experts]."""

    def __init__(self, moe):
        self.counts = torch.zeros(moe.n_experts, dtype=torch.long)

    def __call__(self, idx: torch.Tensor) -> None:
        self.counts += torch.bincount(idx.flatten(), minlength=len(self.counts))


@needs_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "int4"])
@pytest.mark.parametrize("T", [1, 2])
def test_counted_routing_keeps_the_step_kernel_and_counts_what_the_modules_route(precision, T, monkeypatch):
    """A server counts every MoE layer's routed tokens (``RouterCounts``, its /metrics expert load). Its
    counters take counts from the kernels, so every decode step stays one step-kernel call, whose block
    kernels add the experts they choose: the uncounted step kernel's numbers to the bit, and the same
    counts per layer and expert as the module path's over the same tokens (prefill included)."""
    model = model_in(precision, against_modules=True)
    fast = decoder_in(model, "step kernel")
    want = ragged_logits(model, decoder_in(model, "step kernel"), PROMPTS, T=T)
    by_modules = RouterCounts(model)
    ragged_logits(model, model, PROMPTS, T=T)
    by_modules.remove()
    counts = RouterCounts(model)
    calls = count_kernel_calls(monkeypatch)
    got = ragged_logits(model, fast, PROMPTS, T=T)
    counts.remove()
    steps = 3
    assert len(calls["step"]) == steps and len(calls["block"]) == steps  # the MTP layer's block alone
    assert all(p.attention_kernel is None for p in fast.blocks)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert counts() == by_modules() and all(sum(layer) for layer in counts()[0])
    assert all(c.kernel_counts.sum() for c in counts.counts[:-1])  # the main layers' decode steps: the kernel's


@needs_kernels
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 2])
def test_routing_counted_in_python_keeps_the_block_kernels(precision, T, monkeypatch):
    """A counter only Python can call (no ``kernel_counts``): each MoE block then runs its attention half in
    the block kernel and its MoE half on the per-op plan, the block kernels' numbers (to the bit in bf16 and
    FP8), no block through its modules, the module path's counts, and the step kernel back once the counting
    stops."""
    model = model_in(precision, against_modules=True)
    fast = decoder_in(model, "step kernel")
    want = ragged_logits(model, decoder_in(model, "block kernel"), PROMPTS, T=T)
    by_modules = RouterCounts(model)
    ragged_logits(model, model, PROMPTS, T=T)
    by_modules.remove()
    counters = [PythonCounter(moe) for moe in model.moe_layers()]
    for moe, counter in zip(model.moe_layers(), counters, strict=True):
        moe.routed_counters.append(counter)
    calls = count_kernel_calls(monkeypatch)
    got = ragged_logits(model, fast, PROMPTS, T=T)
    assert [p.attention_kernel is not None for p in fast.blocks] == [p.ffn.routed is not None for p in fast.blocks]
    assert all(same_roundings(g, w) for g, w in zip(got, want, strict=True))
    steps, blocks = 3, model.config.num_hidden_layers + 1  # the MTP layer's block too
    assert len(calls["block"]) == steps * blocks and not calls["step"]
    assert [c.counts.tolist() for c in counters] == by_modules()[0]
    for moe in model.moe_layers():
        moe.routed_counters.clear()
    calls["block"].clear()
    ragged_logits(model, fast, PROMPTS, T=T)
    assert len(calls["step"]) == steps and len(calls["block"]) == steps  # the MTP layer's block alone


SHAPES = {"q_lora, softmax routing, no shared expert": dict(q_lora_rank=48, n_shared_experts=0, scoring_func="softmax",
                                                           topk_method="group_limited_greedy"),
          "greedy routing, unnormalised gates": dict(topk_method="greedy", n_group=1, topk_group=1,
                                                     norm_topk_prob=False)}


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_on_other_block_shapes(shape, dtype):
    """Compressed queries (q_a/q_b with their norm, as the small preset and V3), the other routers, and
    MoE layers without a shared expert, through the block kernel; bf16 cache on the bf16 model."""
    from dsv3.config import preset
    from dsv3.model import Transformer

    torch.manual_seed(1)
    model = Transformer(preset("nano").replace(vocab_size=300, num_hidden_layers=2, **SHAPES[shape])).eval().to(dtype)
    ref = step_logits(model, model, PROMPTS[2], T=2).float()
    got = step_logits(model, decoder_in(model, "block kernel"), PROMPTS[2], T=2)
    per_op = step_logits(model, decoder_in(model, "per-op kernels"), PROMPTS[2], T=2)
    assert (got.float() - ref).abs().max() / ref.abs().max() < (3e-2 if dtype == torch.bfloat16 else 2e-6)
    assert same_roundings(got, per_op)


def generate(engine, prompts, n=10):
    return [r.token_ids for r in engine.generate([Request(p, n) for p in prompts])]


def count_kernel_calls(monkeypatch) -> dict[str, list]:
    """Record the fast path's C calls from Python: "block" (one block) and "step" (a whole decode step)."""
    calls = {"block": [], "step": []}
    for kind, name in (("block", "decode_block"), ("step", "decode_step")):
        real = getattr(dk, name)
        monkeypatch.setattr(dk, name, lambda *args, real=real, kind=kind: (calls[kind].append(1), real(*args))[1])
    return calls


def greedy_up_to_ties(model, prompts, outputs, tol: float = 3e-2) -> bool:
    """Whether each token of ``outputs`` is the module path's greedy pick after the tokens before it, or
    within ``tol`` (of the largest logit) of it: teacher-forced along the outputs themselves, one forward
    of each whole sequence. Two bf16 paths that round in different places pick different tokens where the
    two best logits are that close, and from there their outputs part; anything else is a wrong token."""
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1].float()
            picked = logits.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
            if ((logits.max(1).values - picked) > tol * logits.abs().max(1).values).any():
                return False
    return True


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8-fp32"])
@pytest.mark.parametrize("speculative", [False, True])
def test_fast_engine_greedy_tokens_equal_the_module_path(precision, speculative, monkeypatch):
    """fp32 (and FP8 computed in fp32): the module path's tokens exactly. bf16: the module path's picks up to
    near-ties (greedy_up_to_ties; the module engine's own tokens are one such sequence), and with
    speculation exactly the fast engine's plain tokens, which is the speculation's guarantee."""
    model = model_in(precision, against_modules=True)
    ref_engine = Engine(model, speculative=speculative, fast=False)
    fast = Engine(model, speculative=speculative)
    assert isinstance(fast.decoder, FastDecode)
    calls = count_kernel_calls(monkeypatch)
    for prompts in ([PROMPTS[0]], PROMPTS):  # batch 1, then a ragged batch (left padding, holes)
        got = generate(fast, prompts)
        if precision != "bf16":
            assert got == generate(ref_engine, prompts)
            continue
        assert greedy_up_to_ties(model, prompts, got)
        assert greedy_up_to_ties(model, prompts, generate(ref_engine, prompts))  # the check passes the reference
        if speculative:
            assert got == generate(Engine(model), prompts)
    assert calls["step"] or not dk.kernels_available()  # the engine's decode steps ran the step kernel
    assert not speculative or calls["block"] or not dk.kernels_available()  # and the MTP layer its block kernel


@pytest.mark.parametrize("speculative", [False, True])
def test_the_engines_scan_of_the_logits_picks_what_the_per_row_checks_pick(speculative, monkeypatch):
    """Greedy and sampled rows, batch 1 and ragged: the same tokens whether the engine takes a step's scan of
    its logits (the step kernel's own, or one C call) or checks and picks each row by itself."""
    from dsv3.infer.sampling import SamplingParams

    model = model_in("fp32")
    requests = lambda: [Request(p, 8, SamplingParams(temperature=t, seed=3))  # noqa: E731
                        for p, t in zip(PROMPTS, (0.0, 0.8, 0.0), strict=True)]
    scanned = [r.token_ids for r in Engine(model, speculative=speculative).generate(requests())]
    monkeypatch.setattr(FastDecode, "scan_logits", lambda self, logits: None)
    assert [r.token_ids for r in Engine(model, speculative=speculative).generate(requests())] == scanned


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_kernels_own_scan_is_the_scan_of_the_logits_it_wrote(dtype):
    """The step kernel scans the logits it writes (each row's argmax, -1 for a row that is not finite) in the
    same call: ``scan_logits`` gives that for those logits, the same as scanning them by themselves, once;
    logits it did not write (another tensor, or the same after the scan was taken) are scanned anew."""
    model = tiny_model().to(dtype)
    fast = decoder_in(model, "step kernel")
    prompt = PROMPTS[2]
    cache = model.new_cache(3, len(prompt) + 4)
    with torch.inference_mode():
        model(torch.tensor([prompt] * 3), cache=cache)
        _, logits = fast.hidden_and_logits(torch.tensor([[5], [9], [17]]), cache=cache, start_pos=len(prompt))
    assert ran_the_step_kernel(fast)
    fused = fast.scan_logits(logits)
    assert fused == dk.scan_logits(logits) == logits.float().argmax(-1).flatten().tolist()
    with torch.inference_mode():
        logits[1, 0, 7] = float("nan")
    assert fast.scan_logits(logits) == [fused[0], -1, fused[2]]  # taken once: these are scanned anew
    assert fast.scan_logits(logits.clone()) == [fused[0], -1, fused[2]]


@needs_kernels
@pytest.mark.parametrize(("model_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16),
                                                          (torch.bfloat16, torch.float32)])
def test_block_kernel_with_a_cache_of_another_dtype(model_dtype, cache_dtype):
    """The engine's ``cache_dtype``: the block kernel converts the latents it writes, as the cache does."""
    model = tiny_model().to(model_dtype)
    ref = step_logits(model, model, PROMPTS[2], T=2, cache_dtype=cache_dtype)
    per_op = step_logits(model, decoder_in(model, "per-op kernels"), PROMPTS[2], T=2, cache_dtype=cache_dtype)
    block = step_logits(model, decoder_in(model, "block kernel"), PROMPTS[2], T=2, cache_dtype=cache_dtype)
    scale = ref.float().abs().max()
    assert (block.float() - ref.float()).abs().max() / scale < 3e-2
    assert same_roundings(block, per_op)


def test_a_hooked_layer_runs_through_its_module(model):
    """A forward hook (or an expert-parallel dispatcher) on a layer: that layer uses its module."""
    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: calls.append(1))
    try:
        fast = generate(Engine(model), [PROMPTS[0]], 6)
    finally:
        handle.remove()
    assert len(calls) >= 6  # prefill + 5 decode steps
    assert fast == generate(Engine(model, fast=False), [PROMPTS[0]], 6)


def test_a_hook_set_after_the_engine_was_built_is_noticed(model, monkeypatch):
    """The per-step check that the plans still fit the model sees a hook come and go: the hooked layer
    runs its module (the other keeps its block kernel), then the step kernel runs again once it is removed.
    The short prompt's prefill runs block by block on the kernels' absorbed path (``Batch._prompt_hidden``)."""
    engine, expected = Engine(model), generate(Engine(model, fast=False), [PROMPTS[0]], 6)
    seen = []
    calls = count_kernel_calls(monkeypatch)
    blocks = calls["block"]
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda *args: seen.append(1))
    try:
        assert generate(engine, [PROMPTS[0]], 6) == expected
    finally:
        handle.remove()
    assert len(seen) == 6  # prefill + 5 decode steps, all through the module
    assert len(blocks) == (6 if dk.kernels_available() else 0)  # layer 0 kept its block kernel
    assert not calls["step"]
    blocks.clear()
    assert generate(engine, [PROMPTS[0]], 6) == expected
    assert len(calls["step"]) == (5 if dk.kernels_available() else 0)
    assert len(blocks) == (2 if dk.kernels_available() else 0)  # the prefill's, one per layer


def test_with_the_kernels_disabled_fast_decode_runs_pytorch_ops(monkeypatch):
    """DSV3_DECODE_KERNELS=0: no block kernel, no C call; still equal to the module path."""
    monkeypatch.setenv("DSV3_DECODE_KERNELS", "0")
    dk._load.cache_clear()
    try:
        model = tiny_model()
        fast = FastDecode(model)
        assert fast.kernels == "disabled by DSV3_DECODE_KERNELS=0"
        assert all(plan.kernel is None for plan in fast.blocks)
        calls = count_kernel_calls(monkeypatch)
        ref = step_logits(model, model, PROMPTS[2], T=2)
        assert (step_logits(model, fast, PROMPTS[2], T=2) - ref).abs().max() / ref.abs().max() < 2e-6
        assert generate(Engine(model, speculative=True), PROMPTS) == generate(
            Engine(model, speculative=True, fast=False), PROMPTS)
        assert calls == {"block": [], "step": []}
    finally:
        dk._load.cache_clear()


def test_kernels_fall_back_to_pytorch_when_they_cannot_be_built(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV3_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    dk._load.cache_clear()
    try:
        status = dk.kernel_status()
        assert status != "ok" and not dk.kernels_available()
        assert not list((tmp_path / "kernels").glob("*.so")) if (tmp_path / "kernels").exists() else True
        x, w = torch.randn(2, 16), weights("fp32", 8, 16)
        assert torch.allclose(dk.linear(x, w), x @ w.w.t(), atol=1e-6)
        monkeypatch.setenv("DSV3_DECODE_KERNELS", "0")
        dk._load.cache_clear()
        assert dk.kernel_status() == "disabled by DSV3_DECODE_KERNELS=0"
    finally:
        dk._load.cache_clear()


@needs_kernels
@pytest.mark.parametrize("overrides", [{}, {"topk_method": "group_limited_greedy", "scoring_func": "softmax"},
                                       {"topk_method": "greedy", "n_group": 1, "topk_group": 1,
                                        "norm_topk_prob": False}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_kernel_equals_the_router(overrides, dtype):
    from dsv3.config import preset
    from dsv3.model.moe import Router

    cfg = preset("nano").replace(**overrides)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, 0, 0.5)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(9, cfg.hidden_size).to(dtype)
    idx, gates, _ = router(x)
    got_idx, got_gates = dk.route(x, router)
    assert torch.equal(got_idx, idx)
    assert torch.allclose(got_gates, gates, atol=1e-6, rtol=1e-5)


def test_a_bf16_router_is_copied_to_fp32_once_and_again_after_it_changes():
    """The per-op route reads a bf16 router through one fp32 copy kept from call to call; an in-place change
    of the weights (a fine-tune step, a load) makes a new one, so the routing follows the weights."""
    from dsv3.config import preset
    from dsv3.model.moe import Router

    router = Router(preset("nano")).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight, 0, 0.5)
    first, bias = dk._fp32_router(router)
    assert first.dtype == torch.float32 and dk._fp32_router(router)[0] is first
    assert bias is None or bias.dtype == torch.float32
    with torch.no_grad():
        router.weight.mul_(-1)
    again = dk._fp32_router(router)[0]
    assert again is not first and torch.equal(again, router.weight.float())
    x = torch.randn(5, router.weight.shape[1])
    assert torch.equal(dk.route(x, router)[0], router(x)[0])
    fp32 = Router(preset("nano"))
    assert dk._fp32_router(fp32)[0] is not None and dk._fp32_router(fp32)[0].data_ptr() == fp32.weight.data_ptr()


def test_a_layer_changed_after_the_engine_was_built_is_planned_again(model):
    """Swapping a layer's dispatcher (as expert parallelism does) after the engine exists: the fast
    path notices and runs that layer through its module (which here counts its calls)."""
    from dsv3.model.dispatch import LocalDispatcher

    class Counting(LocalDispatcher):
        calls = 0

        def dispatch(self, x, routing):
            Counting.calls += 1
            return (yield from super().dispatch(x, routing))

    engine = Engine(model)
    expected = generate(Engine(model, fast=False), [PROMPTS[0]], 6)
    moe = model.model.layers[1].mlp
    original = moe.dispatcher
    moe.dispatcher = Counting(original.n_experts)
    try:
        assert generate(engine, [PROMPTS[0]], 6) == expected
    finally:
        moe.dispatcher = original
    assert Counting.calls >= 6


def test_a_cache_without_the_mtp_layer(model):
    """A cache with the main layers only: the blocks decode into it; the MTP layer, which has no cache
    layer there, is never written out of bounds (an IndexError, as the module path raises)."""
    from dsv3.model.mla import LatentCache

    prompt, layers = PROMPTS[2], model.config.num_hidden_layers
    logits = []
    for decoder in (model, FastDecode(model)):
        cache = LatentCache(model.config, 1, 32, layers=layers)
        with torch.inference_mode():
            model(torch.tensor([prompt]), cache=cache)
            ids, positions = torch.tensor([[7]]), torch.tensor([[len(prompt)]])
            h = decoder.hidden_states(ids, positions=positions, cache=cache, start_pos=len(prompt))
            logits.append(decoder.lm_head(h))
            with pytest.raises(IndexError):
                decoder.mtp_hidden(0, h, ids, positions, cache=cache, start_pos=len(prompt))
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("B, T", [(1, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_is_the_same_at_every_thread_count(B, T, q_dtype, bf16_path):
    """The attention kernel groups 8 queries per task at one thread and 4 when that keeps a second thread
    busy; a query's arithmetic is the same in either grouping, so the outputs are equal bit for bit."""
    H, nope, r, p, v, S = 8, 16, 40, 8, 12, 150
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, nope + p, generator=g).to(q_dtype)
    angles = torch.rand(B, T, p // 2, generator=g)
    w = torch.randn(H, nope + v, r, generator=g)
    kv, pe = torch.randn(B, S, r, generator=g).bfloat16(), torch.randn(B, S, p, generator=g).bfloat16()
    args = (q, angles.cos(), angles.sin(), w[:, :nope], w[:, nope:], kv, pe, None, 0.3)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(dk.mla_decode(*args))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert close(outs[0], dk.mla_decode_reference(*args, bf16_queries=bf16_dots_on(q, kv)), q_dtype)


@pytest.mark.skipif(not HAS_BF16_DOTS, reason="the CPU lacks AVX512-BF16 (or the kernels are not built)")
def test_bf16_dots_run_for_bf16_models_over_bf16_caches_only():
    """On an AVX512-BF16 CPU the dot-product path is on by default and computes differently (within bf16
    rounding) for bf16 queries over a bf16 cache; fp32 queries or an fp32 cache keep the fp32 path;
    ``DSV3_DECODE_BF16_DOTS=0`` turns it off for a process."""
    H, nope, r, p, v, S = 4, 16, 64, 16, 16, 100
    g = torch.Generator().manual_seed(5)
    w = torch.randn(H, nope + v, r, generator=g)
    angles = torch.rand(1, 1, p // 2, generator=g)
    q32, kv32, pe32 = (torch.randn(1, 1, H, nope + p, generator=g), torch.randn(1, S, r, generator=g),
                       torch.randn(1, S, p, generator=g))

    def both(q, kv, pe):
        args = (q, angles.cos(), angles.sin(), w[:, :nope], w[:, nope:], kv, pe, None, 0.3)
        try:
            return [(dk.bf16_dots(on), dk.mla_decode(*args))[1] for on in (True, False)]
        finally:
            dk.bf16_dots(True)

    dots, fmas = both(q32.bfloat16(), kv32.bfloat16(), pe32.bfloat16())
    assert not torch.equal(dots, fmas) and close(dots, fmas, torch.bfloat16)
    for q, kv, pe in ((q32, kv32.bfloat16(), pe32.bfloat16()), (q32.bfloat16(), kv32, pe32)):
        assert torch.equal(*both(q, kv, pe))
    code = "from dsv3.kernels import decode_kernels as dk; print(dk.bf16_dots())"
    env = {**os.environ, "DSV3_DECODE_BF16_DOTS": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


@needs_kernels
def test_mla_decode_reads_bf16_absorbed_weights_exactly():
    """W_UK/W_UV in bf16 (kv_b_proj's own weight, read in place) give the numbers of their fp32 copy, bit
    for bit; a bf16 model's plan keeps views of the weight, not a copy."""
    B, T, H, nope, r, p, v, S = 1, 2, 8, 16, 40, 8, 12, 70
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, H, nope + p, generator=g).bfloat16()
    angles = torch.rand(B, T, p // 2, generator=g)
    w = torch.randn(H, nope + v, r, generator=g).bfloat16()
    kv, pe = torch.randn(B, S, r, generator=g).bfloat16(), torch.randn(B, S, p, generator=g).bfloat16()
    args = lambda w: (q, angles.cos(), angles.sin(), w[:, :nope], w[:, nope:], kv, pe, None, 0.3)  # noqa: E731
    assert torch.equal(dk.mla_decode(*args(w)), dk.mla_decode(*args(w.float())))
    assert close(dk.mla_decode(*args(w)), dk.mla_decode_reference(*args(w)), torch.bfloat16)
    model = tiny_model().to(torch.bfloat16)
    plan = FastDecode(model).blocks[0].attn
    kv_b = model.model.layers[0].self_attn.kv_b_proj.weight
    assert plan.w_uk.dtype == torch.bfloat16
    assert plan.w_uk.untyped_storage().data_ptr() == kv_b.untyped_storage().data_ptr()


@pytest.mark.parametrize("preset_name", ["nano", "small"])
def test_rope_table_rows_equal_the_angles_of_each_position(preset_name):
    """FastDecode looks a step's cos/sin up in a table made once; every row must be what model.angles gives
    that position alone (bit for bit), for ragged positions, and past the table's size too."""
    from dsv3.config import preset
    from dsv3.kernels.decode import RopeTable
    from dsv3.model import Transformer

    model = Transformer(preset(preset_name))
    table = RopeTable(model)
    for p in range(0, 3000, 7):
        got = table(torch.tensor([[p]]), 4096)
        assert all(torch.equal(g, w) for g, w in zip(got, model.angles(torch.tensor([[p]])), strict=True))
    ragged = torch.tensor([[5, 6], [2999, 3000], [0, 1]])
    assert all(torch.equal(g, w) for g, w in zip(table(ragged, 16), model.angles(ragged), strict=True))
    past = torch.tensor([[table.cos.shape[0] + 3]])
    assert all(torch.equal(g, w) for g, w in zip(table(past, 16), model.angles(past), strict=True))
