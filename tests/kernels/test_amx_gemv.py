"""bf16 GEMVs in AMX tiles (``amx_gemv_rows`` under ``dsv3_linear`` and ``dsv3_swiglu_experts``): on a CPU with
AMX-BF16 a bf16 matrix times bf16 activations, with the matrix's columns a multiple of 32, multiplies 16 x 32
tiles of the weights read in place. Each output is its own row's fp32 chain over the columns, so it must match
float64 arithmetic to fp32 rounding, give every row of a 1..64-row call the bits it has alone (what batched
decode relies on), give the same bits at any thread count, and leave alone what it does not take (columns not a
multiple of 32, fewer than 16 rows of weights, fp32 activations)."""

import pytest
import torch

from dsv3.kernels import decode_kernels as dk

needs_amx = pytest.mark.skipif(not (dk.kernels_available() and dk.amx()),
                               reason="needs AMX-BF16 (CPU and kernel) and the C kernels")


@pytest.fixture(autouse=True)
def _tiles_on_after():
    yield
    dk.amx(True)
    torch.set_num_threads(1)


def linear(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """dsv3_linear with an fp32 output (the tiles' own sums, before any rounding to bf16)."""
    lib = dk._load()[0]
    out = torch.empty(x.shape[0], w.shape[0])
    lib.dsv3_linear(w.data_ptr(), None, dk.W_KIND[w.dtype], w.shape[0], w.shape[1], x.data_ptr(),
                    dk.A_KIND[x.dtype], x.shape[0], out.data_ptr(), dk.A_KIND[torch.float32], threads)
    return out


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# (rows of weights N, columns K): one tile, a partial last tile (N not a multiple of 16, so the last tile starts
# at N - 16), a long K, and N cut unevenly between threads
SHAPES = [(16, 32), (300, 1024), (1537, 96), (100, 3072)]


@needs_amx
@pytest.mark.parametrize("N,K", SHAPES)
def test_rows_match_float64_and_their_own_bits_alone(N, K):
    w, x = bf16(N, K, seed=1), bf16(64, K, seed=2)
    want = x.double() @ w.double().T
    got = linear(x, w)
    assert ((got.double() - want).norm() / want.norm()) < 1e-6
    for rows in (1, 3, 16, 17, 40, 64):
        alone = torch.cat([linear(x[m:m + 1].contiguous(), w) for m in range(rows)])
        assert torch.equal(linear(x[:rows].contiguous(), w), alone), f"{rows} rows differ from the rows alone"


@needs_amx
def test_tiles_are_taken_and_agree_with_the_fmas():
    """The tiles sum in another order than the FMAs' micro-tiles: different bits (so the tiles did run), the
    same numbers to fp32 rounding."""
    w, x = bf16(300, 1024, seed=3), bf16(16, 1024, seed=4)
    tiles = linear(x, w)
    dk.amx(False)
    fmas = linear(x, w)
    assert not torch.equal(tiles, fmas)
    assert ((tiles - fmas).norm() / fmas.norm()) < 1e-6


@needs_amx
def test_the_thread_count_changes_no_bit():
    w, x = bf16(1537, 1024, seed=5), bf16(16, 1024, seed=6)
    assert torch.equal(linear(x, w, threads=1), linear(x, w, threads=2))
    assert torch.equal(linear(x, w, threads=1), linear(x, w, threads=3))


@needs_amx
@pytest.mark.parametrize("N,K,dtype", [(300, 1000, torch.bfloat16), (8, 1024, torch.bfloat16),
                                       (300, 1024, torch.float32)])
def test_shapes_and_activations_it_does_not_take_keep_their_path(N, K, dtype):
    w, x = bf16(N, K, seed=7), bf16(5, K, seed=8).to(dtype)
    tiles = linear(x, w)
    dk.amx(False)
    assert torch.equal(tiles, linear(x, w))


def experts(E, I, D, seed=0):
    return dk.ExpertWeights(*(dk.Weight(bf16(E, *s, seed=seed + i)) for i, s in enumerate([(I, D), (I, D), (D, I)])))


@needs_amx
def test_a_shared_expert_in_tiles_matches_float64_and_gives_each_row_its_bits_alone():
    """One expert (a dense MLP, the shared experts) over 1..40 rows takes the tiles; a stack of routed experts
    keeps the FMAs (a row or two each in a decode step), so its bits do not change with the tiles."""
    gen = torch.Generator().manual_seed(4)
    shared = experts(1, 64, 96, seed=10)
    x = (torch.randn(40, 96, generator=gen) / 8).bfloat16()
    idx, gates = torch.zeros(40, 1, dtype=torch.long), torch.ones(40, 1)
    got = dk.swiglu_experts(x, idx, gates, shared)
    g, u, d = (w.double() for w in shared.expert(0))
    h = torch.nn.functional.silu(x.double() @ g.T) * (x.double() @ u.T)
    want = h.bfloat16().double() @ d.T  # the SwiGLU output rounded to bf16, as the module path rounds it
    assert ((got.double() - want).norm() / want.norm()) < 1e-2
    alone = torch.cat([dk.swiglu_experts(x[m:m + 1], idx[m:m + 1], gates[m:m + 1], shared) for m in range(40)])
    assert torch.equal(got, alone)
    dk.amx(False)
    assert not torch.equal(got, dk.swiglu_experts(x, idx, gates, shared))  # the tiles ran
    routed = experts(5, 96, 128)
    x = (torch.randn(16, 128, generator=gen) / 8).bfloat16()
    idx = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(16)])
    gates = torch.rand(16, 2, generator=gen)
    fmas = dk.swiglu_experts(x, idx, gates, routed)
    dk.amx(True)
    assert torch.equal(dk.swiglu_experts(x, idx, gates, routed), fmas)
