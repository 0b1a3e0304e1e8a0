"""The decode kernels as custom ops (``torch.ops.dsv3.*``, dsv3/kernels/ops.py) against their references: each
op called through the dispatcher on the C build (where it runs) equals the plain PyTorch computation, at 1
and 2 threads and 1 to 64 rows (the kernels' range; 65 rows take the reference), for the weight and
activation dtypes the kernels read; the ops trace under ``torch.compile(fullgraph=True)``; and a build of
another ABI is refused with its reason, the references running in its place."""

import pytest
import torch
import torch.nn.functional as F

from dsv3.config import preset
from dsv3.kernels import c_build
from dsv3.kernels import decode_kernels as dk
from dsv3.model.moe import Router
from dsv3.precision.fp8 import dequantize_weight_blocks, quantize_weight_blocks

needs_kernels = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")
ROWS = [1, 3, 64, 65]  # one row, a partial micro-tile, the kernels' most, and one past it (the reference)


def weight(kind: str, *shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(the op's weight, its FP8 scales or None, the weight as the reference reads it in fp32)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5
    if kind == "fp8":
        pairs = [quantize_weight_blocks(m) for m in w.reshape(-1, *shape[-2:])]
        q = torch.stack([p[0] for p in pairs]).view(shape)
        s = torch.stack([p[1] for p in pairs]).view(*shape[:-2], *pairs[0][1].shape)
        return q, s, dequantize_weight_blocks(q, s, torch.float32)
    w = w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind])
    return w, None, w.float()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to fp32 summation order (fp32), or to a few bf16 roundings of the largest value (bf16: the
    reference rounds its intermediates to bf16 where the kernels keep fp32)."""
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32 x", "bf16 x"])
def test_linear(threads, rows, kind, act):
    w, s, dense = weight(kind, 136, 200)  # FP8 blocks cut at N and K
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).to(act)
    got = torch.ops.dsv3.linear(x, w, s)
    close(got, (x.float() @ dense.t()).to(act), act)


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32 x", "bf16 x"])
def test_swiglu_experts(threads, rows, kind, act):
    (g, gs, gd), (u, us, ud), (d, ds, dd) = (weight(kind, 4, *shape, seed=i)
                                              for i, shape in enumerate([(24, 40), (24, 40), (40, 24)]))
    rng = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 40, generator=rng).to(act)
    idx = torch.randint(0, 4, (rows, 2), generator=rng)
    idx[:, 1] = (idx[:, 0] + 1) % 4  # two distinct experts a row
    gates = torch.rand(rows, 2, generator=rng)
    add_to = torch.randn(rows, 40, generator=rng).to(act)
    want = torch.zeros(rows, 40)
    for m in range(rows):
        for j in range(2):
            e, xm = idx[m, j], x[m].float()
            want[m] += gates[m, j] * (dd[e] @ (F.silu(gd[e] @ xm) * (ud[e] @ xm)))
    close(torch.ops.dsv3.swiglu_experts(x, idx, gates, g, u, d, gs, us, ds), want.to(act), act)
    close(torch.ops.dsv3.swiglu_experts(x, idx, gates, g, u, d, gs, us, ds, add_to), (add_to.float() + want).to(act),
          act)


ROUTERS = {"V3: sigmoid, noaux_tc, 4 groups": {},
           "V2: softmax, group-limited greedy": dict(scoring_func="softmax", topk_method="group_limited_greedy"),
           "V2-Lite: softmax, greedy": dict(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1)}


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_chooses_the_routers_experts(threads, rows, name):
    fields = dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    cfg = preset("nano").replace(**{**fields, **ROUTERS[name]})
    router = Router(cfg)
    g = torch.Generator().manual_seed(rows)  # fixed inputs, whatever ran before (a near-tie could part them)
    router.weight.data = torch.randn(router.weight.shape, generator=g)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    x = torch.randn(rows, cfg.hidden_size, generator=g)
    idx, gates = torch.ops.dsv3.route(
        x, router.weight, router.e_score_correction_bias, router.top_k,
        router.n_group if router.method != "greedy" else 1, router.topk_group, router.scoring == "softmax",
        router.method == "noaux_tc", router.norm_topk_prob, router.route_scale)
    want_idx, want_gates, _ = router(x)
    assert idx.dtype == torch.long and gates.dtype == torch.float32
    order, want_order = idx.sort(-1), want_idx.sort(-1)  # the same experts, in whichever order
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(gates.gather(1, order.indices), want_gates.gather(1, want_order.indices))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "masked"])
def test_mla_decode(threads, rows, dtype, masked):
    H, nope, rope, r, v, S, T = 4, 16, 8, 32, 16, 37, 1
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, T, H, nope + rope, generator=g).to(dtype)
    angles = torch.rand(rows, T, rope // 2, generator=g) * 6
    w_uk, w_uv = (torch.randn(H, n, r, generator=g).div(r ** 0.5).to(dtype) for n in (nope, v))
    kv, pe = torch.randn(rows, S, r, generator=g).to(dtype), torch.randn(rows, S, rope, generator=g).to(dtype)
    bias = None
    if masked:
        bias = torch.zeros(rows, T, S)
        bias[:, :, 5::3] = float("-inf")
    args = (q, angles.cos(), angles.sin(), w_uk, w_uv, kv, pe, bias, 0.3)
    got = torch.ops.dsv3.mla_decode(*args)
    want = dk.mla_decode_reference(*args, bf16_queries=dtype == torch.bfloat16 and dk.bf16_dots())
    close(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_reads_only_the_tiles_a_row_sees(threads, dtype):
    """A row right-aligned beside a longer one (a merged batch) sees only its last keys, and a prefill chunk's
    first query only its first ones: the kernel skips the whole 32-key tiles outside them, so NaN there (never
    read) leaves the output equal to the reference over finite keys; the old loop over every tile gave NaN."""
    H, nope, rope, r, v, S, T = 4, 16, 8, 32, 16, 200, 2
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, T, H, nope + rope, generator=g).to(dtype)
    angles = torch.rand(2, T, rope // 2, generator=g) * 6
    w_uk, w_uv = (torch.randn(H, n, r, generator=g).div(r ** 0.5).to(dtype) for n in (nope, v))
    kv, pe = torch.randn(2, S, r, generator=g).to(dtype), torch.randn(2, S, rope, generator=g).to(dtype)
    bias = torch.zeros(2, T, S)
    bias[0, :, :130] = float("-inf")  # row 0 holds slots 130.. only: tiles 0-3 are never seen
    bias[1, :, 70:] = float("-inf")  # row 1 sees slots ..69: tiles 3.. are never seen
    args = (q, angles.cos(), angles.sin(), w_uk, w_uv, kv, pe, bias, 0.3)
    want = dk.mla_decode_reference(*args, bf16_queries=dtype == torch.bfloat16 and dk.bf16_dots())
    kv[0, :128], pe[0, :128], kv[1, 96:], pe[1, 96:] = float("nan"), float("nan"), float("nan"), float("nan")
    got = torch.ops.dsv3.mla_decode(*args)
    assert torch.isfinite(got).all()
    close(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(threads, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 72, generator=g).to(dtype), torch.rand(72, generator=g).to(dtype)
    want = w * F.rms_norm(x.float(), (72,), eps=1e-6).to(dtype)
    close(torch.ops.dsv3.rms_norm(x, w, 1e-6), want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_logits_picks_the_first_largest_and_flags_rows_that_are_not_finite(dtype):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 7] = logits[0, 250] = 100  # a tie: the first
    logits[1, 3], logits[2, 9] = float("nan"), float("inf")
    want = logits.argmax(-1)
    want[1:3] = -1
    got = torch.ops.dsv3.scan_logits(logits)
    assert got.dtype == torch.long and got.tolist() == want.tolist() and got[0] == 7


def all_ops(x, w, s, idx, gates, experts, router, attention, norm_w):
    """A small step's worth of every op (the compiled test's graph)."""
    h = torch.ops.dsv3.rms_norm(x, norm_w, 1e-6)
    h = torch.ops.dsv3.linear(h, w, s)
    chosen, gate_values = torch.ops.dsv3.route(h, *router)
    out = torch.ops.dsv3.swiglu_experts(h, chosen, gate_values, *experts)
    out = torch.ops.dsv3.swiglu_experts(h, idx, gates, *experts, add_to=out)
    q, cos, sin, w_uk, w_uv, kv, pe = attention
    att = torch.ops.dsv3.mla_decode(q, cos, sin, w_uk, w_uv, kv, pe, None, 0.25)
    return out, att, torch.ops.dsv3.scan_logits(out)


def test_the_ops_trace_into_one_graph_and_run_compiled_as_eager():
    """register_fake gives every op's shapes, so a function of all of them compiles with fullgraph=True (a
    graph break would be an error) and gives the eager numbers, on the C build or the references alike."""
    torch.manual_seed(0)
    w, s, _ = weight("fp8", 40, 40)
    experts = [weight("fp32", 4, *shape, seed=i)[0] for i, shape in enumerate([(24, 40), (24, 40), (40, 24)])]
    router = (torch.randn(8, 40), torch.zeros(8), 2, 2, 1, False, True, True, 1.0)
    attention = (torch.randn(2, 1, 4, 24), torch.rand(2, 1, 4).cos(), torch.rand(2, 1, 4).sin(),
                 torch.randn(4, 16, 32), torch.randn(4, 16, 32), torch.randn(2, 9, 32), torch.randn(2, 9, 8))
    args = (torch.randn(2, 40), w, s, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), experts, router,
            attention, torch.rand(40))
    compiled = torch.compile(all_ops, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), all_ops(*args), strict=True):
        assert torch.equal(got, want)


def test_a_build_of_another_abi_is_refused_with_its_reason_and_the_references_run(monkeypatch, tmp_path):
    """A library under the cached name whose calling interface differs (built here from the same source with
    another DSV3_KERNELS_ABI) is never called: the status says why, and the ops give the references' numbers."""
    if c_build.cpu_supported():
        pytest.skip(c_build.cpu_supported())
    monkeypatch.setenv("DSV3_CACHE", str(tmp_path))
    dk._load.cache_clear()
    try:
        stale = dk.library_path()
        c_build.build(stale, dk.SOURCE, ("-DDSV3_KERNELS_ABI=999",))
        status = dk.kernel_status()
        assert status == f"refused {stale.name}: its ABI is 999, this dsv3 calls ABI {dk.ABI}"
        assert not dk.kernels_available() and stale.exists()
        x, w = torch.randn(3, 16), torch.randn(8, 16)
        assert torch.equal(torch.ops.dsv3.linear(x, w), F.linear(x, w))
        assert dk.scan_logits(x) is None  # the engine's own per-row check runs
    finally:
        dk._load.cache_clear()
