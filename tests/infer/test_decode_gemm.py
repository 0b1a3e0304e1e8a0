"""The GEMV core's many-row micro-kernel (decode_kernels.c: gemv_tiles for 2 to 64 activation rows) keeps the
documented contract that a row's result does not depend on how many rows share the call: for fp32, bf16
and FP8 weights, every row of a 1..64-row call is bit for bit the row computed alone, on shapes that cut
every loop (K not a multiple of 8, 16 or 128; N not a multiple of the 4-row tile; FP8 blocks cut at N and
K), with subnormal FP8 weights, and at every thread count. Batched decode and MTP verification rely on it:
they must give the single-row numbers."""

import pytest
import torch

from dsv3.kernels import decode_kernels as dk
from dsv3.precision.fp8 import quantize_weight_blocks

pytestmark = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")

KINDS = ["fp32", "bf16", "fp8"]
# (N, K): a partial tile and K below one vector; no 16-step; a scalar tail after an 8-step; FP8 blocks cut at
# N and K with a 16-step, an 8-step and a scalar tail; a full FP8 block and a partial one in both; FP8's
# 32-column groups followed by a 16-column block, an 8-step and a scalar tail.
SHAPES = [(3, 7), (5, 8), (6, 27), (130, 203), (261, 264), (67, 250)]


def weight(kind: str, n: int, k: int, seed: int = 0) -> dk.Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if kind == "fp8":
        q, s = quantize_weight_blocks(w)
        return dk.Weight(q, s, torch.float32)
    return dk.Weight(w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind]))


def rows_alone(x: torch.Tensor, w: dk.Weight) -> torch.Tensor:
    return torch.cat([dk.linear(row[None], w) for row in x])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_every_row_count_gives_the_single_row_bits(kind, shape):
    """Calls of 1 to 64 rows (every micro-tile grouping: 3s, a last 2, 2 + 2) against the rows one by one."""
    n, k = shape
    w = weight(kind, n, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    alone = rows_alone(x, w)
    for rows in range(1, 65):
        got = dk.linear(x[:rows], w)
        assert torch.equal(got, alone[:rows]), f"{rows} rows differ from the rows computed alone"


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_bf16_activations_and_outputs_keep_the_single_row_bits(kind):
    w = weight(kind, 130, 203)
    x = torch.randn(37, 203, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = rows_alone(x, w)
    for rows in (2, 3, 4, 5, 9, 16, 37):
        assert torch.equal(dk.linear(x[:rows], w), alone[:rows])


@pytest.mark.parametrize("kind", KINDS)
def test_routed_experts_give_each_row_its_single_row_bits(kind):
    """dsv3_swiglu_experts with 16 rows sharing 5 experts (so an expert sees 1 to many rows): each row's
    output is the output of that row routed alone."""
    E, I, D = 5, 137, 131
    experts = dk.ExpertWeights(*(dk.Weight(torch.stack([weight(kind, *s, seed=10 * seed + e).w for e in range(E)]),
                                           None if kind != "fp8" else torch.stack(
                                               [weight(kind, *s, seed=10 * seed + e).scale_inv for e in range(E)]),
                                           torch.float32 if kind == "fp8" else None)
                                 for seed, s in enumerate([(I, D), (I, D), (D, I)])))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, D, generator=gen) / 8
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(16)])
    gates = torch.rand(16, 2, generator=gen)
    got = dk.swiglu_experts(x, idx, gates, experts)
    for m in range(16):
        assert torch.equal(got[m:m + 1], dk.swiglu_experts(x[m:m + 1], idx[m:m + 1], gates[m:m + 1], experts)), m


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_bf16_times_bf16_keeps_the_single_row_bits_on_either_path(shape, bf16_path):
    """Every row count 1..64 (the dot products' micro-tiles of 6 rows, every remainder) against the rows
    alone, and either path within the bf16 output's rounding of the exact products' sum."""
    n, k = shape
    w = weight("bf16", n, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alone = rows_alone(x, w)
    for rows in range(1, 65):
        assert torch.equal(dk.linear(x[:rows], w), alone[:rows]), f"{rows} rows differ from the rows computed alone"
    exact = x.double() @ w.w.double().t()
    assert torch.allclose(alone.double(), exact, rtol=2**-8, atol=1e-5 * exact.abs().max().item())


def test_routed_experts_with_bf16_activations_on_either_path(bf16_path):
    """Gate and up projections of bf16 activations (the dot products, where they run), the down projection of
    the kernel's fp32 intermediate: each row's output is that row's routed alone, and near the reference."""
    E, I, D = 5, 137, 131
    experts = dk.ExpertWeights(*(dk.Weight(torch.stack([weight("bf16", *s, seed=10 * seed + e).w for e in range(E)]))
                                 for seed, s in enumerate([(I, D), (I, D), (D, I)])))
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(16, D, generator=gen) / 8).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(16)])
    gates = torch.rand(16, 2, generator=gen)
    got = dk.swiglu_experts(x, idx, gates, experts)
    for m in range(16):
        assert torch.equal(got[m:m + 1], dk.swiglu_experts(x[m:m + 1], idx[m:m + 1], gates[m:m + 1], experts)), m
    ref = dk.swiglu_experts_reference(x, idx, gates, experts).float()
    assert ((got.float() - ref).norm() / ref.norm()) < 1e-2
