"""Emulate a tensor core's limited-precision accumulation, with and without promotion to FP32.

The ISCA paper describes Hopper's FP8 MMA: 32 products are aligned by right-shifting to the largest
exponent, only the highest 13 fraction bits are kept (the rest truncated), and results are accumulated
in FP22 registers (1 sign, 8 exponent, 13 mantissa bits). Following Fasi et al.'s measurements of
NVIDIA tensor cores, the running accumulator joins the alignment as one more addend by default
(``align_with_accumulator``), so once it is large every small product loses its low bits. The V3
recipe's remedy, promotion, adds the narrow partial sum into an FP32 register every ``N_C`` products
and restarts it from zero.

All functions work on a batch of independent dot products at once (float64 numpy, exact for the
shifts and sums involved), so K = 16384 over hundreds of trials takes well under a second.
"""

from __future__ import annotations

import numpy as np

from dsv3.errors import DSV3Error

HOPPER_FRACTION_BITS = 13
HOPPER_GROUP = 32  # products aligned together: one WGMMA's K for FP8


def truncate_to_grid(values: np.ndarray, quantum: np.ndarray) -> np.ndarray:
    """Drop every bit below ``quantum`` (a power of two), rounding toward zero as a right shift does."""
    return np.trunc(values / quantum) * quantum


def leading_bit(values: np.ndarray) -> np.ndarray:
    """2**floor(log2 |v|) along the last axis's maximum: the weight of the largest term's leading bit."""
    top = np.abs(values).max(axis=-1)
    _, exponent = np.frexp(np.where(top > 0, top, 1.0))  # top in [2**(e-1), 2**e)
    return np.ldexp(1.0, exponent - 1)


def round_to_narrow(values: np.ndarray, fraction_bits: int) -> np.ndarray:
    """Store in a float with ``fraction_bits`` mantissa bits (FP22 for 13), truncating."""
    quantum = leading_bit(values[..., None]) * 2.0**-fraction_bits
    return truncate_to_grid(values, quantum)


def limited_dot(
    products: np.ndarray,
    fraction_bits: int = HOPPER_FRACTION_BITS,
    group: int = HOPPER_GROUP,
    promote_every: int | None = None,
    align_with_accumulator: bool = True,
) -> np.ndarray:
    """Sum ``products: [T, K]`` (exact FP8 products) as the emulated tensor core does; returns [T].

    ``promote_every`` (N_C, a multiple of ``group``) adds the narrow partial sum into an FP32
    accumulator every N_C products, as the V3 recipe does; ``None`` accumulates all of K narrowly.
    """
    products = np.asarray(products, dtype=np.float64)
    if products.ndim != 2:
        raise DSV3Error(f"products must be [trials, K], got shape {products.shape}")
    if promote_every is not None and (promote_every < group or promote_every % group):
        raise DSV3Error(f"promotion interval {promote_every} must be a positive multiple of the group {group}")
    trials, k = products.shape
    narrow = np.zeros(trials)
    wide = np.zeros(trials, dtype=np.float32)
    for start in range(0, k, group):
        terms = products[:, start : start + group]
        if align_with_accumulator:
            terms = np.concatenate([narrow[:, None], terms], axis=1)
        quantum = leading_bit(terms)[:, None] * 2.0**-fraction_bits
        total = truncate_to_grid(terms, quantum).sum(axis=1)  # exact: few bits, float64
        if not align_with_accumulator:
            total = total + narrow
        narrow = round_to_narrow(total, fraction_bits)
        if promote_every is not None and (start + group) % promote_every == 0:
            wide = wide + narrow.astype(np.float32)  # FP32 add on the CUDA cores
            narrow = np.zeros(trials)
    return wide.astype(np.float64) + narrow


def fp8_random(shape: tuple[int, int], dist: str, rng: np.random.Generator) -> np.ndarray:
    """Random E4M3 values with one scale per tensor, returned as the raw FP8 numbers (scale dropped).

    Per-tensor scaling is what an unpromoted GEMM can use: with 1x128 scales the partial sums of
    different K chunks carry different scales and cannot share one accumulator. The common scale
    cancels from relative errors, and raw FP8 products (8 significant bits, exponents -18..17) sum
    exactly in float64 for any K up to 2**16.
    """
    import torch

    from dsv3.precision import fp8

    if dist == "uniform":
        x = rng.random(shape)
    elif dist == "normal":
        x = rng.standard_normal(shape)
    else:
        raise DSV3Error(f"unknown input distribution {dist!r}; expected 'uniform' or 'normal'")
    q, _ = fp8.quantize_per_tensor(torch.from_numpy(x).float())
    return q.double().numpy()


def relative_errors(
    k: int,
    trials: int,
    dist: str = "uniform",
    promote_every: int | None = None,
    seed: int = 0,
    **kwargs,
) -> np.ndarray:
    """|limited - exact| / |exact| for ``trials`` random FP8 dot products of length ``k``."""
    rng = np.random.default_rng(seed)
    a, b = fp8_random((trials, k), dist, rng), fp8_random((trials, k), dist, rng)
    products = a * b  # exact in float64
    exact = products.sum(axis=1)  # exact too: see fp8_random
    approx = limited_dot(products, promote_every=promote_every, **kwargs)
    return np.abs(approx - exact) / np.abs(exact)
