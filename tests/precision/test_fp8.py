"""Fine-grained FP8 quantization and the promoted scaled GEMM, against straightforward references."""

import math

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.precision import fp8


def reference_quantize(x: torch.Tensor, block, fmt="e4m3", pow2=False):
    """The recipe spelled out tile by tile: amax (>= 1e-4) / fmt_max, optional 2**ceil(log2), divide, cast."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    top = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    rows, cols = x.shape
    br, bc = block
    q = torch.empty(rows, cols, dtype=dtype)
    scales = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            tile = x[i : i + br, j : j + bc].float()
            amax = max(float(tile.abs().max()), 1e-4)
            scale = torch.tensor(amax, dtype=torch.float32) / top
            if pow2:
                scale = torch.tensor(2.0 ** math.ceil(math.log2(float(scale))), dtype=torch.float32)
            q[i : i + br, j : j + bc] = (tile / scale).to(dtype)
            scales[i // br, j // bc] = scale
    return q, scales


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)])
@pytest.mark.parametrize("shape", [(256, 384), (130, 300), (5, 77)])
@pytest.mark.parametrize("fmt,pow2", [("e4m3", False), ("e4m3", True), ("e5m2", False)])
def test_quantize_is_bit_exact_to_the_recipe(block, shape, fmt, pow2):
    gen = torch.Generator().manual_seed(sum(shape) + block[0])
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 2, shape[1])  # wide per-channel ranges
    x[0, :7] = 0.0  # a partly-zero tile
    q, scale = fp8.quantize(x, block=block, fmt=fmt, pow2_scale=pow2)
    q_ref, scale_ref = reference_quantize(x, block, fmt, pow2)
    assert scale.shape == scale_ref.shape == fp8.scale_shape(shape, block)
    assert q.dtype == q_ref.dtype
    assert torch.equal(scale, scale_ref)
    assert torch.equal(bits(q), bits(q_ref))


def test_scale_is_amax_over_448_and_tile_max_maps_to_448():
    x = torch.zeros(2, 256)
    x[0, 3] = -896.0  # tile (0, 0): amax 896 -> scale 2
    x[1, 200] = 44.8  # tile (1, 1): amax 44.8 -> scale 0.1
    q, scale = fp8.quantize(x)
    assert scale[0, 0].item() == pytest.approx(2.0)
    assert scale[1, 1].item() == pytest.approx(0.1)
    assert scale[0, 1].item() == pytest.approx(1e-4 / 448)  # all-zero tile: amax clamped at 1e-4
    assert q[0, 3].float().item() == -448.0 and q[1, 200].float().item() == 448.0
    assert q[0, 128:].float().abs().sum().item() == 0.0


def test_pow2_scales_are_powers_of_two_at_least_the_plain_scale():
    x = torch.randn(64, 1000) * 37.0
    _, plain = fp8.quantize(x)
    q, scale = fp8.quantize(x, pow2_scale=True)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)
    assert torch.all(scale >= plain) and torch.all(scale < 2 * plain)
    assert q.float().abs().max() <= 448.0


@pytest.mark.parametrize("fmt,rel,sub", [("e4m3", 2.0**-4, 2.0**-10), ("e5m2", 2.0**-3, 2.0**-17)])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)])
def test_dequantize_round_trip_within_half_an_fp8_ulp(fmt, rel, sub, block):
    """|x - dq(q(x))| <= max(rel * |x|, sub * scale): half a mantissa ulp, or half a subnormal step."""
    x = torch.randn(200, 333, generator=torch.Generator().manual_seed(1)) * 3.0
    q, scale = fp8.quantize(x, block=block, fmt=fmt)
    back = fp8.dequantize(q, scale, block)
    per_elem_scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:200, :333]
    bound = torch.maximum(rel * x.abs(), sub * per_elem_scale) * (1 + 1e-6)
    assert torch.all((x - back).abs() <= bound)
    assert (x - back).abs().max() > 0  # the quantization is real, not a pass-through


def test_leading_dims_are_rows_for_activation_tiles():
    x = torch.randn(3, 5, 256)
    q, scale = fp8.quantize(x)
    assert scale.shape == (3, 5, 2)
    q2, scale2 = fp8.quantize(x.reshape(15, 256))
    assert torch.equal(bits(q.reshape(15, 256)), bits(q2)) and torch.equal(scale.reshape(15, 2), scale2)


def test_per_tensor_quantization_has_one_scale():
    x = torch.randn(10, 300)
    q, scale = fp8.quantize_per_tensor(x)
    assert scale.shape == () and scale.item() == pytest.approx(x.abs().max().item() / 448)
    assert q.shape == x.shape


def test_bad_input_is_a_clear_error():
    with pytest.raises(DSV3Error, match="format"):
        fp8.quantize(torch.randn(4, 4), fmt="e3m4")
    with pytest.raises(DSV3Error, match="scale shape"):
        fp8.dequantize(torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 3))
    a_q, a_s = fp8.quantize(torch.randn(8, 256))
    with pytest.raises(DSV3Error, match="b_scale"):
        fp8.scaled_mm(a_q, a_s, a_q, a_s)  # B given 1x128 scales while claiming 128x128 blocks


def float64_product(a_q, a_s, b_q, b_s, b_block):
    a = fp8.dequantize(a_q, a_s, (1, 128), torch.float64)
    b = fp8.dequantize(b_q, b_s, b_block, torch.float64)
    return a @ b.t(), a.abs() @ b.abs().t()


@pytest.mark.parametrize("backend", ["dequantized", "chunked"])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("m,n,k", [(64, 256, 1024), (37, 200, 300), (1, 129, 128)])
def test_scaled_mm_matches_float64_on_dequantized_operands(backend, b_block, m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    a_q, a_s = fp8.quantize(torch.randn(m, k, generator=gen) * 4)
    b_q, b_s = fp8.quantize(torch.randn(n, k, generator=gen) * 0.02, block=b_block)
    got = fp8.scaled_mm(a_q, a_s, b_q, b_s, out_dtype=torch.float32, b_block=b_block, backend=backend)
    want, magnitude = float64_product(a_q, a_s, b_q, b_s, b_block)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.linalg.norm(got.double() - want) <= 1e-5 * torch.linalg.norm(want)
    assert torch.all((got.double() - want).abs() <= 1e-5 * magnitude + 1e-30)


def test_scaled_mm_uses_each_chunks_own_scales():
    """A K chunk scaled 1000x larger must weigh 1000x more: scales are per chunk, not per row."""
    a = torch.ones(1, 256)
    a[:, 128:] = 1000.0
    b = torch.ones(1, 256)
    a_q, a_s = fp8.quantize(a)
    b_q, b_s = fp8.quantize(b, block=(128, 128))
    out = fp8.scaled_mm(a_q, a_s, b_q, b_s, out_dtype=torch.float32, backend="chunked")
    assert out.item() == pytest.approx(128 * 1 + 128 * 1000, rel=1e-6)


def test_scaled_mm_bf16_output_and_error_against_unquantized_product():
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(128, 512, generator=gen), torch.randn(256, 512, generator=gen)
    a_q, a_s = fp8.quantize(a)
    b_q, b_s = fp8.quantize(b, block=(128, 128))
    out = fp8.scaled_mm(a_q, a_s, b_q, b_s)
    assert out.dtype == torch.bfloat16
    exact = a.double() @ b.double().t()
    rel = torch.linalg.norm(out.double() - exact) / torch.linalg.norm(exact)
    assert 1e-3 < rel < 0.05  # E4M3's 3 mantissa bits: a few percent at most, never zero


def test_unknown_backend_is_rejected():
    a_q, a_s = fp8.quantize(torch.randn(4, 128))
    b_q, b_s = fp8.quantize(torch.randn(4, 128), block=(128, 128))
    with pytest.raises(DSV3Error, match="backend"):
        fp8.scaled_mm(a_q, a_s, b_q, b_s, backend="cutlass")
    for name in fp8.CUDA_BACKENDS:  # CPU tensors: no CUDA kernel, whether dsv3.kernels registered them or not
        with pytest.raises(DSV3Error, match=f"{name}' is not available: it is a CUDA kernel and these operands "
                                            "are on cpu"):
            fp8.scaled_mm(a_q, a_s, b_q, b_s, backend=name)


def test_the_gemm_is_one_torch_op_that_traces_whole():
    """scaled_mm runs torch.ops.dsv3.fp8_blockwise_mm (dsv3.kernels registers its CUDA kernels); its fake lets
    torch.compile(fullgraph=True) trace a graph that calls it, with the eager numbers."""
    a_q, a_s = fp8.quantize(torch.randn(5, 300))
    b_q, b_s = fp8.quantize(torch.randn(7, 300), block=(128, 128))
    direct = torch.ops.dsv3.fp8_blockwise_mm(a_q, a_s, b_q, b_s, torch.float32, 128, "chunked")
    assert torch.equal(fp8.scaled_mm(a_q, a_s, b_q, b_s, torch.float32, backend="chunked"), direct)
    compiled = torch.compile(lambda *t: fp8.scaled_mm(*t, torch.bfloat16) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a_q, a_s, b_q, b_s), fp8.scaled_mm(a_q, a_s, b_q, b_s) * 2)
