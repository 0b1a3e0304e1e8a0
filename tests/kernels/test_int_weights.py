"""Group-wise integer weights (dsv3.precision.int_groups) and their decode ops (dsv3/kernels/int_weights.py):
the format round-trips and matches its documented layout; each op through ``torch.ops.dsv3`` on the C build
equals its PyTorch reference at 1 to 64 rows (65 takes the reference), 1 and 2 threads, int8 and int4,
on the AVX-512 path and the AVX2 one; a model with integer experts decodes through the kernels as its
modules do."""

import pytest
import torch
import torch.nn.functional as F

from dsv3.config import preset
from dsv3.kernels import int_weights as iw
from dsv3.precision.int_groups import GROUP, dequantize, quantize, round_activations

needs_kernels = pytest.mark.skipif(iw.int_kernel_status() != "ok", reason=f"C kernels: {iw.int_kernel_status()}")
ROWS = [1, 3, 9, 16, 17, 64, 65]  # one row, partial tiles, a full AVX-512 tile, past it, the most, the reference


@pytest.fixture(params=[True, False], ids=["avx512", "avx2"])
def path(request):
    if request.param and not iw.avx512(True):
        pytest.skip("this CPU has no AVX-512")
    iw.avx512(request.param)
    yield request.param
    iw.avx512(True)


def test_int8_layout_and_error_bound():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    q, s = quantize(w, 8)
    assert q.dtype == torch.int8 and q.shape == (4, 64) and s.dtype == torch.float16 and s.shape == (4, 2)
    groups = w.unflatten(-1, (-1, GROUP))
    torch.testing.assert_close(s.float(), (groups.abs().amax(-1) / 127).half().float())
    assert q.abs().max() == 127
    # rounding to the nearest level: at most half a step per value
    assert ((dequantize(q, s) - w).abs().unflatten(-1, (-1, GROUP)) <= s.float()[..., None] / 2 + 1e-6).all()


def test_int4_layout_nibbles_and_extreme_value():
    w = torch.zeros(1, 32)
    w[0, 3], w[0, 20], w[0, 7] = -2.0, 1.0, 0.5  # -2.0 has the largest magnitude: d = -2 / -8 = 0.25
    q, s = quantize(w, 4)
    assert q.dtype == torch.uint8 and q.shape == (1, 16) and s.item() == 0.25
    assert q[0, 3].item() & 0x0F == -8 + 8  # value 3 (-2.0 / 0.25 = -8) in byte 3's low nibble
    assert q[0, 4].item() >> 4 == 4 + 8  # value 20 (1.0 / 0.25 = 4) in byte 4's high nibble
    assert q[0, 7].item() & 0x0F == 2 + 8 and q[0, 0].item() == 8 | (8 << 4)
    torch.testing.assert_close(dequantize(q, s), w)


@pytest.mark.parametrize("bits", [8, 4])
def test_requantizing_a_dequantized_weight_gives_it_back(bits):
    w = torch.randn(3, 2, 96, generator=torch.Generator().manual_seed(1))
    q, s = quantize(w, bits)
    q2, s2 = quantize(dequantize(q, s), bits)
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_a_dimension_that_is_not_whole_groups_is_refused():
    from dsv3.errors import DSV3Error

    with pytest.raises(DSV3Error, match="multiple of 32"):
        quantize(torch.randn(4, 40), 8)


def _weight(bits, *shape, seed=0):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5
    return quantize(w, bits)


def test_activations_round_to_int8_within_half_a_step_per_group():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    x[1, :32] = 0.0  # a group of zeros stays zeros
    step = x.reshape(3, -1, GROUP).abs().amax(-1, keepdim=True) / 127
    seen = round_activations(x)
    err = (seen - x).reshape(3, -1, GROUP).abs()
    assert (err <= step / 2 * (1 + 1e-5)).all() and err.max() > 0 and not seen[1, :32].any()
    levels = seen.reshape(3, -1, GROUP) / step.clamp_min(1e-30)
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 127 + 1e-4


def test_the_avx512_path_takes_vnni_where_the_cpu_has_it():
    import re

    if iw.int_kernel_status() != "ok":
        pytest.skip(f"C kernels: {iw.int_kernel_status()}")
    flags = set(re.findall(r"\w+", open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0]))
    try:
        assert iw.vnni() == (iw.avx512(True) and "avx512_vnni" in flags)
        iw.avx512(False)
        assert not iw.vnni()
    finally:
        iw.avx512(True)


def _close(got, want, dtype, fp32_tol=1e-5):
    assert got.dtype == dtype and got.shape == want.shape
    tol = fp32_tol if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32 x", "bf16 x"])
@pytest.mark.parametrize("cols", [160, 256], ids=["a partial block", "whole blocks"])  # int4: 128 a block
def test_int_linear(threads, path, rows, bits, act, cols):
    q, s = _weight(bits, 74, cols)
    x = torch.randn(rows, cols).to(act)
    got = torch.ops.dsv3.int_linear(x, q, s)
    _close(got, (round_activations(x) @ dequantize(q, s).t()).to(act), act)


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32 x", "bf16 x"])
@pytest.mark.parametrize("add", [False, True], ids=["", "add_to"])
def test_int_swiglu_experts(threads, path, rows, bits, act, add):
    E, I, D, K = 6, 64, 96, 2
    gate, up, down = _weight(bits, E, I, D, seed=1), _weight(bits, E, I, D, seed=2), _weight(bits, E, D, I, seed=3)
    x = torch.randn(rows, D).to(act)
    idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(r))[:K] for r in range(rows)])
    gates = torch.rand(rows, K)
    add_to = torch.randn(rows, D).to(act) if add else None
    got = torch.ops.dsv3.int_swiglu_experts(x, idx, gates, *gate, *up, *down, add_to)
    want = torch.zeros(rows, D) if add_to is None else add_to.float()
    dense = [dequantize(*p) for p in (gate, up, down)]
    for m in range(rows):
        for j in range(K):
            e = idx[m, j]
            xm = round_activations(x[m])
            h = F.silu(xm @ dense[0][e].t()) * (xm @ dense[1][e].t())
            want[m] += round_activations(gates[m, j] * h) @ dense[2][e].t()
    # h differs from the reference's in the last bits, so its rounding to int8 can land a step (1/127 of its
    # group's largest) away: measured up to 3.2e-3 of the largest output at 64 rows; a wrong group, scale or
    # offset is off by the output's own size
    _close(got, want.to(act), act, fp32_tol=1e-2)


@needs_kernels
def test_an_expert_index_outside_the_stack_is_an_error_not_a_wild_read():
    gate, up, down = _weight(8, 2, 32, 32), _weight(8, 2, 32, 32), _weight(8, 2, 32, 32)
    with pytest.raises(IndexError):
        torch.ops.dsv3.int_swiglu_experts(torch.randn(1, 32), torch.tensor([[2]]), torch.ones(1, 1), *gate, *up,
                                          *down)


def test_ops_trace_under_torch_compile():
    q, s = _weight(4, 32, 64)
    fn = torch.compile(lambda x: torch.ops.dsv3.int_linear(x, q, s) * 2, fullgraph=True, backend="eager")
    x = torch.randn(2, 64)
    torch.testing.assert_close(fn(x), 2 * torch.ops.dsv3.int_linear(x, q, s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_model_with_integer_experts_decodes_through_the_kernels_as_through_its_modules(bits, path, monkeypatch):
    """The engine's CPU step (FastDecode: the whole step in one C call, the integer experts read in the block
    kernels, not through ``int_swiglu_experts``) gives the greedy tokens of the module path (each expert
    dequantized as its rows run), at batch 3 with rows finishing apart, on the AVX-512 path and the AVX2 one."""
    from dsv3.infer.engine import Engine, Request
    from dsv3.kernels.decode import FastDecode
    from dsv3.model import Transformer

    torch.manual_seed(0)
    model = iw.to_int_weights(Transformer(preset("nano").replace(num_hidden_layers=2)).eval(), bits)
    assert any(isinstance(m, iw.IntExperts) for m in model.modules())
    assert any(isinstance(m, iw.IntLinear) for m in model.modules())
    g = torch.Generator().manual_seed(bits)
    prompts = [torch.randint(0, 4096, (3 + 2 * b,), generator=g).tolist() for b in range(3)]

    def tokens(engine):
        return [r.token_ids for r in engine.generate([Request(p, 6 + 3 * b) for b, p in enumerate(prompts)])]

    fast = Engine(model, eos_token_ids=frozenset())
    assert type(fast.decoder) is FastDecode
    calls, original = [], iw.IntExpertWeights.swiglu
    monkeypatch.setattr(iw.IntExpertWeights, "swiglu", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    got = tokens(fast)
    monkeypatch.undo()
    if iw.int_kernel_status() == "ok":
        assert fast.decoder._step_kernel is not None and not calls, "the integer experts ran outside the step kernel"
    assert got == tokens(Engine(model, fast=False, eos_token_ids=frozenset()))
