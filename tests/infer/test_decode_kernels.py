"""The GEMV core of the decode kernels (decode_kernels.c: dsv3_linear, dsv3_swiglu_experts) on the shapes
that exercise its edges: K not a multiple of 8, 16 or 128 (the vector loops' tails), N not a multiple of
the 4-row tile (a partial last tile), FP8 128x128 blocks cut at N and K, 1 to 64 activation rows (one
activation row per tile, micro-tiles of two and three rows, the converted panel from 24 on), bf16
activations and outputs, several threads, and swiglu's accumulate flag. Each is compared, element by
element, with a float64 reference on the same (dequantized) weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv3.kernels import decode_kernels as dk
from dsv3.kernels import int_weights as iw
from dsv3.precision.fp8 import quantize_weight_blocks

pytestmark = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")


def make_weight(kind: str, n: int, k: int, lead: tuple[int, ...] = (), seed: int = 0) -> dk.Weight:
    """Random weights [*lead, n, k]; the 128-row blocks get magnitudes 1, 8, 64, ... so that a block scale
    applied to the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=g) * (8.0 ** (torch.arange(n) // 128)).view(n, 1)
    if kind == "fp8":
        pairs = [quantize_weight_blocks(m) for m in w.reshape(-1, n, k)]
        q = torch.stack([p[0] for p in pairs]).view(*lead, n, k)
        s = torch.stack([p[1] for p in pairs]).view(*lead, *pairs[0][1].shape)
        return dk.Weight(q, s, torch.float32)
    return dk.Weight(w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind]))


def dense64(w: dk.Weight) -> torch.Tensor:
    """The weights as the reference reads them, in float64 (FP8: each block times its scale)."""
    if w.scale_inv is None:
        return w.w.double()
    n, k = w.w.shape[-2:]
    s = w.scale_inv.double().repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
    return w.w.double() * s


def assert_matches(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, out_dtype: torch.dtype) -> None:
    """|got - ref| within fp32 accumulation error of sum |x||w| (``bound``), plus the output's rounding."""
    tol = 2e-6 * bound + (2 ** -8 if out_dtype == torch.bfloat16 else 1e-7) * ref.abs()
    err = (got.double() - ref).abs()
    worst = (err - tol).argmax()
    assert bool((err <= tol).all()), f"element {worst.item()}: got {got.flatten()[worst]}, want {ref.flatten()[worst]}"


# (N, K): one row and one column; a partial tile and a K below one vector; K = 8 (no 16-step);
# K with an 8-step and a scalar tail; N and K cutting FP8 blocks; a full block plus a partial one.
SHAPES = [(1, 1), (3, 7), (5, 8), (6, 27), (130, 203), (257, 136)]


@pytest.fixture(params=["avx512", "avx2"])
def gemv_path(request):
    """The GEMVs on their AVX-512 micro-tiles (bf16 x bf16 then in FMAs on Intel CPUs), or on the AVX2 ones (bf16
    x bf16 in dot products where the CPU has them, as on AMD Zen 4)."""
    if request.param == "avx512" and not iw.avx512(True):
        pytest.skip("needs AVX-512F")
    iw.avx512(request.param == "avx512")
    yield request.param
    iw.avx512(True)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_linear_on_edge_shapes_and_row_counts(kind, act, shape, gemv_path):
    n, k = shape
    w = make_weight(kind, n, k)
    ref_w = dense64(w)
    for rows in (1, 2, 3, 4, 5, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(act)
        got = dk.linear(x, w)
        assert got.dtype == act and got.shape == (rows, n)
        assert_matches(got, x.double() @ ref_w.t(), x.double().abs() @ ref_w.abs().t(), act)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_linear_batched_leading_dims_and_64_rows_in_one_call(act, gemv_path):
    """x [2, 32, K] is 64 rows: one kernel call, the same rows as 64 single-row calls."""
    w = make_weight("bf16", 70, 96)
    x = torch.randn(2, 32, 96).to(act)
    got = dk.linear(x, w)
    assert got.shape == (2, 32, 70)
    one_by_one = torch.stack([dk.linear(row[None], w)[0] for row in x.view(64, 96)]).view(2, 32, 70)
    assert torch.equal(got, one_by_one)  # a row's sum does not depend on the rows beside it


@pytest.mark.parametrize("rows", [3, 16])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_linear_is_the_same_at_every_thread_count(kind, rows):
    """Threads split the weight rows; every output is computed by one thread with the same code, so the
    result is bit-for-bit the same at 1, 2 and 3 threads (and over the parallel threshold)."""
    w = make_weight(kind, 301, 260)
    x = torch.randn(rows, 260)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(dk.linear(x, w))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def on_both_paths(fn):
    """fn() with the kernels' AVX-512 micro-tiles on, then with the AVX2 ones, both in FMAs (bf16 dot products
    off); both switches restored after."""
    dots = dk.bf16_dots()
    try:
        dk.bf16_dots(False)
        return [(iw.avx512(on), fn())[1] for on in (True, False)]
    finally:
        iw.avx512(True)
        dk.bf16_dots(dots)


@pytest.mark.skipif(not iw.avx512(True), reason="needs AVX-512F")
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_avx512_micro_tiles_give_the_avx2_sums_to_the_bit(kind, act):
    """Several activation rows of fp32 or bf16 weights (or a converted panel: FP8 from 8 rows, bf16 from 24), and
    FP8 weights read in place from one row on, run in AVX-512 micro-tiles whose lanes hold the AVX2 tile's two
    chains: the same products in the same order, so the outputs equal the AVX2 path's bit for bit, on every
    edge shape (K past whole 64-column FP8 groups: 16-column blocks, an 8-step, a scalar tail) and row count."""
    for n, k in [*SHAPES, (64, 512), (9, 219)]:
        w = make_weight(kind, n, k)
        for rows in (1, 2, 3, 4, 6, 7, 8, 13, 16, 24, 25, 64):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(act)
            wide, avx2 = on_both_paths(lambda: dk.linear(x, w))  # noqa: B023 (called at once)
            assert torch.equal(wide, avx2), (n, k, rows)


@pytest.mark.skipif(not iw.avx512(True), reason="needs AVX-512F")
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_avx512_swiglu_experts_equal_the_avx2_path(kind):
    """The routed experts at 16 rows (each expert a few rows, the down projections over fp32 activations) and a
    shared expert every row goes to: the same outputs on both paths."""
    E, I, D = 8, 137, 136
    experts = dk.ExpertWeights(*(make_weight(kind, *s, (E,), seed) for seed, s in enumerate([(I, D), (I, D),
                                                                                            (D, I)])))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, D, generator=gen).to(torch.bfloat16 if kind != "fp32" else torch.float32) / 8
    idx = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(16)])
    gates = torch.rand(16, 3, generator=gen)
    shared = (torch.zeros(16, 1, dtype=torch.int64), torch.ones(16, 1))
    for i, g in ((idx, gates), shared):
        wide, avx2 = on_both_paths(lambda: dk.swiglu_experts(x, i, g, experts))  # noqa: B023
        assert torch.equal(wide, avx2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 64])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_fp8_reads_every_e4m3_code_exactly_even_with_denormals_flushed(rows, act, gemv_path):
    """All 254 finite e4m3 codes, each picked out by a one-hot activation (at each of the four byte positions
    of a 64-column group, in both of its halves, in a last 16-column block, an 8-step and the scalar tail;
    single-row and many-row kernels, AVX-512 and AVX2; bf16 activations, which take the bf16 dot products where
    the CPU has them and AVX512-VBMI): the kernel's conversion is the dequantization bit for bit, subnormals
    included, also when the process flushes denormals (the fp32 path turns DAZ off while it runs, and
    restores it; the dot products convert to bf16, where an e4m3 subnormal is a normal number)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    K = 219  # 3 groups of 64, a 16-column block, an 8-step, 3 columns of tail
    w = dk.Weight(finite[:, None].expand(-1, K).contiguous(), torch.full((2, 2), 0.25), torch.float32)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for col in (3, 5, 34, 40, 130, 132, 166, 169, 200, 211, 217):
            x = torch.zeros(rows, K, dtype=act)
            x[:, col] = 1.0
            got = dk.linear(x, w)
            assert torch.equal(got, (finite.float() * 0.25).to(act).expand(rows, -1))
        assert torch.tensor([1e-40]).mul(1.0).item() == 0.0  # still flushing after the kernel ran
    finally:
        torch.set_flush_denormal(False)


def swiglu64(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, experts: dk.ExpertWeights) -> torch.Tensor:
    """SwiGLU experts in float64 on the dequantized weights (the activations rounded as the kernel reads
    them): sum_j gates[m, j] * down_e(silu(gate_e x) * up_e x)."""
    g, u, d = (dense64(w) for w in (experts.gate, experts.up, experts.down))
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for m in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[m, j]
            h = torch.nn.functional.silu(g[e] @ xd[m]) * (u[e] @ xd[m])
            out[m] += gates[m, j].double() * (d[e] @ h)
    return out


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_swiglu_experts_on_edge_shapes(kind, act, gemv_path):
    """I and D not multiples of 4, 16 or 128 (FP8 blocks cut in both matrices); 1 to 64 rows routed with
    shared experts (so an expert sees 1, 2 or many rows); accumulate on and off; 1 and 2 threads."""
    E, I, D = 5, 137, 131
    experts = dk.ExpertWeights(*(make_weight(kind, *s, (E,), seed) for seed, s in enumerate([(I, D), (I, D),
                                                                                            (D, I)])))
    for p in (experts.gate, experts.up, experts.down):  # moderate magnitudes: silu stays in its curved part
        if p.scale_inv is None:
            p.w = (p.w.float() / 64).to(p.w.dtype)
        else:
            p.scale_inv = p.scale_inv / 64
            p.kernel_scale = p.kernel_scale / 64
    before = torch.get_num_threads()
    try:
        for threads, rows in ((1, 1), (2, 2), (1, 3), (2, 17), (2, 64)):
            torch.set_num_threads(threads)
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, D, generator=gen).to(act)
            idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(rows)])
            gates = torch.rand(rows, 2, generator=gen)
            ref = swiglu64(x, idx, gates, experts)
            scale = ref.abs().max()
            got = dk.swiglu_experts(x, idx, gates, experts)
            assert got.dtype == act
            # bf16 activations: with the dot products (bf16 and FP8 weights) the SwiGLU output is rounded to
            # bf16 before the down projection, as the module path rounds it (whose own error here is 3.4e-3 to
            # 9.8e-3)
            tol = 1e-2 if act == torch.bfloat16 else 2e-5
            assert ((got.double() - ref).abs() / scale).max() < tol
            base = torch.randn(rows, D, generator=gen).to(act)
            summed = dk.swiglu_experts(x, idx, gates, experts, add_to=base.clone())
            assert ((summed.double() - (base.double() + ref)).abs() / scale).max() < 2 * tol + (
                2 ** -8 * base.double().abs().max() / scale if act == torch.bfloat16 else 0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 24, 16391])
def test_logit_scan_equals_torch_and_finds_every_non_finite_value(dtype, n):
    """dsv3_scan_logits (the engine's check and greedy pick): torch.argmax's first index on ties (in the
    vector loop and in its tail), and -1 for a row, and only that row, holding one NaN or +-inf anywhere."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-4, 4, (4, n), generator=g).to(dtype)  # many ties
    x[1] = torch.randn(n, generator=g).to(dtype)
    x[3] = -1.0
    x[3, n - 1] = 5.0  # the maximum in the tail
    assert dk.scan_logits(x) == x.float().argmax(-1).tolist()
    assert dk.scan_logits(x.view(2, 2, n)) == x.float().argmax(-1).tolist()
    for bad in (float("nan"), float("inf"), float("-inf")):
        for row, col in ((0, 0), (2, n - 1), (1, n // 2)):
            y = x.clone()
            y[row, col] = bad
            want = x.float().argmax(-1).tolist()
            want[row] = -1
            assert dk.scan_logits(y) == want
    if n > 1:
        assert dk.scan_logits(x.t()) is None  # not contiguous: the caller's fallback
    assert dk.scan_logits(x.double()) is None


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_kernels_speed.py"


def test_speed_benchmark_reports_every_figure_as_json_and_refuses_bad_flags():
    """A one-round run of benchmarks/decode_kernels_speed.py on one small matrix: one JSON object with the
    read bandwidth and, per (kind, rows, threads), the kernel's and torch's GB/s and the fraction; int4's bytes
    count its fp16 group scales (18 bytes per 32 weights)."""
    done = subprocess.run([sys.executable, str(BENCH), "--matrices", "q_a", "--kinds", "bf16,fp8,int4",
                           "--threads", "1", "--rows", "1,2", "--repeats", "1", "--footprint-mb", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bandwidth_gbs"]["1"] > 0
    assert [(r["kind"], r["rows"]) for r in report["results"]] == [
        ("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2), ("int4", 1), ("int4", 2)]
    for r in report["results"]:
        assert r["weight_bytes"] == 192 * 512 * {"bf16": 2, "fp8": 1, "int4": 18 / 32}[r["kind"]]
        assert r["kernel_gbs"] > 0 and r["torch_gbs"] > 0
        assert r["kernel_fraction_of_bw"] == pytest.approx(r["kernel_gbs"] / report["bandwidth_gbs"]["1"])
    bad = subprocess.run([sys.executable, str(BENCH), "--kinds", "fp4"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ["error: --kinds must list some of fp32,bf16,fp8,int8,int4, got 'fp4'"]


def test_step_benchmark_times_both_sides_at_each_batch_size():
    """decode_step_ab: one row per (dtype, threads, batch, context) with both sides' step times and roofline
    fractions; a bad --dtypes ends with one error line and status 2."""
    bench = Path(__file__).parents[2] / "benchmarks" / "decode_step_ab.py"
    flags = ["--baseline-rev", "HEAD", "--preset", "nano", "--dtypes", "bf16", "--threads", "1", "--batches", "1,2",
             "--contexts", "16", "--steps", "1", "--rounds", "1", "--json"]
    done = subprocess.run([sys.executable, str(bench), *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert [(r["dtype"], r["batch"], r["context"]) for r in rows] == [("bf16", 1, 16), ("bf16", 2, 16)]
    for r in rows:
        for side in ("baseline (HEAD)", "this tree"):
            assert r[side]["ms_per_step"] > 0 and 0 < r[side]["roofline_fraction"]
            assert r[side]["tokens_per_s"] == pytest.approx(1000 * r["batch"] / r[side]["ms_per_step"])
    bad = subprocess.run([sys.executable, str(bench), "--dtypes", "int2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ["error: --dtypes: each one of fp32, bf16, fp8, int8, int4, got 'int2'"]


def test_descriptors_are_filled_by_name_in_c_and_an_unknown_field_is_refused():
    """The block and step descriptors are laid out by the C compiler alone: Python sets their fields by name
    (``dsv3_desc_set``), so a field on one side only is refused by its name instead of writing into the
    wrong place (the FastDecode tests check that the values set are the ones the kernels read)."""
    block = dk.Descriptor("block", dim=16, q_a={"n": 4, "k": 16}, input_eps=1e-6, q_norm=None)
    assert block.address and block.fields["q_a"] == {"n": 4, "k": 16}
    with pytest.raises(RuntimeError, match="no field q_a.bias"):
        dk.Descriptor("block", q_a={"bias": 0})
    with pytest.raises(RuntimeError, match="no field layer"):
        dk.Descriptor("step", layer=0)  # a block's field, not a step's
