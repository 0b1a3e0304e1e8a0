"""The decode attention over an fp32 cache (``dsv3_mla_decode``) on its two paths: AVX-512 FMAs (``z_task``,
where the CPU has AVX-512F) and AVX2 FMAs (``att_task``, the baseline; ``int_weights.avx512(False)`` forces it).
Each against the PyTorch reference, at latent and RoPE widths that leave a partial 16-lane vector, heads that
leave a partial group of four queries, masked keys, one and two query tokens a row; each independent of the
thread count to the bit; and the two paths within fp32 summation order of each other."""

import pytest
import torch

from dsv3.kernels import decode_kernels as dk
from dsv3.kernels import int_weights as iw

needs_kernels = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")


@pytest.fixture(params=["avx512", "avx2"])
def path(request):
    """The fp32 attention on its AVX-512 path or its AVX2 one; restored after."""
    if request.param == "avx512" and not iw.avx512(True):
        pytest.skip("needs AVX-512F")
    iw.avx512(request.param == "avx512")
    yield request.param
    iw.avx512(True)


def case(rows: int, T: int, heads: int, r: int, p: int, S: int, seed: int) -> tuple:
    """mla_decode's arguments over an fp32 cache of S slots, every third key from slot 5 masked."""
    g = torch.Generator().manual_seed(seed)
    nope, v = 16, 24
    q = torch.randn(rows, T, heads, nope + p, generator=g)
    angles = torch.rand(rows, T, p // 2, generator=g) * 6
    w_uk, w_uv = (torch.randn(heads, n, r, generator=g) / r ** 0.5 for n in (nope, v))
    kv, pe = torch.randn(rows, S, r, generator=g), torch.randn(rows, S, p, generator=g)
    bias = torch.zeros(rows, T, S)
    bias[:, :, 5::3] = float("-inf")
    bias[:, 0, S - 1] = float("-inf")  # the first query token does not see the last slot (a chunk's causal end)
    return q, angles.cos(), angles.sin(), w_uk, w_uv, kv, pe, bias, 0.3


# (r, p): whole vectors; r with a half vector left (a masked last load); both partial; the model's small shape
WIDTHS = [(32, 16), (40, 8), (72, 24), (128, 32)]


@needs_kernels
@pytest.mark.parametrize("r,p", WIDTHS)
@pytest.mark.parametrize("rows,T,heads", [(1, 1, 3), (5, 2, 4), (16, 1, 8)])
def test_fp32_attention_equals_the_reference_at_any_thread_count(path, r, p, rows, T, heads):
    args = case(rows, T, heads, r, p, S=75, seed=r + rows)
    want = dk.mla_decode_reference(*args)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.ops.dsv3.mla_decode(*args))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernels
@pytest.mark.skipif(not iw.avx512(True), reason="needs AVX-512F")
@pytest.mark.parametrize("r,p", WIDTHS)
def test_fp32_attention_paths_agree_to_summation_order(r, p):
    """The AVX-512 scores sum in another order than the AVX2 ones (16 lanes folded to 8, against 8 lanes): the
    outputs agree to fp32 rounding, and differ in some last bits (so the switch does reach the attention)."""
    args = case(3, 2, 4, r, p, S=300, seed=p)
    try:
        outs = [(iw.avx512(on), torch.ops.dsv3.mla_decode(*args))[1] for on in (True, False)]
    finally:
        iw.avx512(True)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5 * outs[1].abs().max().item())
    assert not torch.equal(outs[0], outs[1])
