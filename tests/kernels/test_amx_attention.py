"""The bf16 attention in AMX tiles (``decode_kernels.amx``): on a CPU with AMX-BF16 a bf16 model's attention over
a bf16 cache multiplies 16 x 32 tiles instead of VDPBF16PS vectors. It takes the dot-product path's roundings
(queries and softmax weights in bf16, sums in fp32), so it must match the same reference, agree with that path
within bf16 rounding, give the same bits at any thread count (its tasks group queries differently with the
threads), and read in place or through a copy whatever the latent widths (multiples of 32 or not). Paged caches:
tests/kernels/test_paged_decode.py runs every case there on this path too."""

import os
import subprocess
import sys

import pytest
import torch

from dsv3.kernels import decode_kernels as dk

needs_amx = pytest.mark.skipif(not (dk.kernels_available() and dk.amx()),
                               reason="needs AMX-BF16 (CPU and kernel) and the C kernels")
NEG = float("-inf")

# (heads, nope, rope, latent r, v, cached slots S, tokens T, rows B): widths in place (r, rope multiples of 32),
# widths copied (r = 40, rope = 8), V3's own latent (512 + 64), several 128-key tiles with a prefill chunk, and
# one row of 16 heads over three segments of keys (a decode step at batch 1, which the threads share by segment).
SHAPES = [(4, 16, 32, 64, 16, 33, 1, 1), (4, 16, 8, 40, 16, 200, 2, 3), (16, 16, 64, 512, 16, 300, 1, 2),
          (2, 16, 32, 96, 16, 1000, 8, 1), (16, 16, 64, 512, 16, 1500, 1, 1)]


def case(H, nope, rope, r, v, S, T, B, mask, seed=0):
    """Arguments of ``mla_decode`` in bf16; ``mask``: None, "causal" (token t sees all but the last T - 1 - t
    slots, as a prefill chunk does) or "merged" (row b right-aligned: its first 37 * b slots masked)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, nope + rope, generator=g).bfloat16()
    angles = torch.rand(B, T, rope // 2, generator=g) * 6
    w_uk, w_uv = (torch.randn(H, n, r, generator=g).div(r ** 0.5).bfloat16() for n in (nope, v))
    kv, pe = torch.randn(B, S, r, generator=g).bfloat16(), torch.randn(B, S, rope, generator=g).bfloat16()
    bias = None
    if mask == "causal":
        bias = torch.zeros(B, T, S)
        for t in range(T):
            bias[:, t, S - (T - 1 - t):] = NEG
    elif mask == "merged":
        bias = torch.zeros(B, T, S)
        for b in range(B):
            bias[b, :, :37 * b] = NEG
    return q, angles.cos(), angles.sin(), w_uk, w_uv, kv, pe, bias, 0.3


def run(args, amx: bool, threads: int) -> torch.Tensor:
    """The op with the tiles on or off (the dot products on) at a thread count; the process's settings restored."""
    before_amx, before_threads = dk.amx(), torch.get_num_threads()
    try:
        dk.amx(amx)
        torch.set_num_threads(threads)
        return torch.ops.dsv3.mla_decode(*args)
    finally:
        dk.amx(before_amx)
        torch.set_num_threads(before_threads)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a few bf16 roundings of the largest value (the summation orders differ)."""
    assert got.dtype == want.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def same_bits_at_both_thread_counts_and_close(args) -> None:
    """The tiles give the same bits at 1 and 2 threads, within bf16 roundings of the reference."""
    one = run(args, True, 1)
    assert torch.equal(one, run(args, True, 2))
    close(one, dk.mla_decode_reference(*args, bf16_queries=True))


@needs_amx
@pytest.mark.parametrize("mask", [None, "causal", "merged"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-r{}-rope{}-S{}-T{}-B{}".format(*s[:1], *s[3:4],
                                                                                                *s[2:3], *s[5:]))
def test_tiles_match_the_reference_and_the_dot_products_at_any_thread_count(shape, mask):
    args = case(*shape, mask, seed=sum(shape))
    one, two = run(args, True, 1), run(args, True, 2)
    assert torch.equal(one, two)
    close(one, dk.mla_decode_reference(*args, bf16_queries=True))
    dots = run(args, False, 1)
    close(one, dots)
    if shape[5] > 128:  # past one block of keys the sums run in another order: proof the tiles ran
        assert not torch.equal(one, dots)


@needs_amx
def test_tiles_skip_the_slots_no_query_sees():
    """NaN before a right-aligned row's first slot and past a prefill chunk's last one: never read (whole
    128-key blocks start at the first 32-key tile a query sees), so the output is the one over finite slots."""
    args = case(4, 16, 32, 64, 16, 400, 2, 2, "merged", seed=9)
    kv, pe, bias = args[5].clone(), args[6].clone(), args[7].clone()
    bias[0, :, 390:] = NEG  # row 0 sees slots ..389
    want = run((*args[:5], kv, pe, bias, args[8]), True, 1)
    kv[1, :32], pe[1, :32], kv[0, 390:], pe[0, 390:] = float("nan"), float("nan"), float("nan"), float("nan")
    for threads in (1, 2):
        assert torch.equal(run((*args[:5], kv, pe, bias, args[8]), True, threads), want)


@needs_amx
def test_tiles_turn_off_with_the_dot_products_and_by_environment():
    """No tiles without the bf16 dot products (fp32 paths compute differently); ``DSV3_DECODE_AMX=0`` turns
    them off for a process while leaving the dot products on."""
    dots = dk.bf16_dots()
    try:
        dk.bf16_dots(False)
        assert not dk.amx()
    finally:
        dk.bf16_dots(dots)
    assert dk.amx()
    code = "from dsv3.kernels import decode_kernels as dk; print(dk.amx(), dk.bf16_dots())"
    env = {**os.environ, "DSV3_DECODE_AMX": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr


@needs_amx
def test_a_query_gets_the_same_bits_whichever_queries_share_its_task():
    """Two tokens of a row with different first visible slots (a sliding window): one thread attends both in
    one task from the earlier slot, two threads one each from its own; the 128-key blocks sit at the same
    slots either way, so every bit agrees, and with the reference."""
    args = case(4, 16, 32, 64, 16, 400, 2, 1, None, seed=11)
    bias = torch.zeros(1, 2, 400)
    bias[0, 0, :40], bias[0, 1, :100] = NEG, NEG  # first visible tiles at 32 and 96
    same_bits_at_both_thread_counts_and_close((*args[:7], bias, args[8]))


@needs_amx
def test_segments_no_query_sees_add_nothing():
    """Keys cut into segments of 512 slots, merged per query: a row that sees only the last segment, one whose
    visible slots straddle two, and one that sees all, against the reference and at both thread counts."""
    args = case(16, 16, 64, 128, 16, 1300, 1, 3, None, seed=5)
    bias = torch.zeros(3, 1, 1300)
    bias[0, :, :1100], bias[1, :, :450], bias[1, :, 700:] = NEG, NEG, NEG
    same_bits_at_both_thread_counts_and_close((*args[:7], bias, args[8]))


@needs_amx
def test_one_segment_seen_gives_the_bits_of_a_cache_of_one_segment():
    """A cache of 1,000 slots whose rows see only the first 400 (two segments, merged) and the same cache cut
    to those 400 slots (one segment, no merge): the same bits, at both thread counts."""
    q, cos, sin, w_uk, w_uv, kv, pe, _, scale = case(16, 16, 64, 128, 16, 1000, 1, 2, None, seed=8)
    bias = torch.zeros(2, 1, 1000)
    bias[:, :, 400:] = NEG
    for threads in (1, 2):
        long = run((q, cos, sin, w_uk, w_uv, kv, pe, bias, scale), True, threads)
        cut = run((q, cos, sin, w_uk, w_uv, kv[:, :400].contiguous(), pe[:, :400].contiguous(), None, scale), True,
                  threads)
        assert torch.equal(long, cut)
