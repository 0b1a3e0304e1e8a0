"""Emulate a tensor core's limited-precision accumulation, with and without promotion to FP32.

Default model: Hopper's FP8 ``wgmma`` (k = 32) as two bit-accurate reference models, each checked
bit for bit against real GPUs, describe it: MMA-Sim (Xie et al., "MMA-Sim: Bit-Accurate Reference
Model of Tensor Cores and Matrix Cores", arXiv:2511.10909, github.com/microsoft/MMA-Sim: Hopper FP8
``wgmma`` is their truncated fused dot-product-add with F = 13, L_max = 32, output RZ-E8M13) and
Khattak & Mikaitis ("Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004,
github.com/north-numerical-computing/MATLAB-tensor-core, ``H100TC.m``: FP8 inputs, 32-term fused
add, 13 fraction bits, round toward zero). One instruction adds 32 exact products to the running
accumulator C:

- every product's alignment exponent is the sum of its factors' exponents (its significand lies in
  [1, 4)), C's is its own; the largest of these sets the window;
- each of the 33 terms keeps 13 fraction bits below that exponent, truncated toward zero
  (sign-magnitude: ``product_rounding="toward_zero"``);
- the exact sum of the kept terms is normalized and truncated toward zero to 13 fraction bits: FP22
  (1 sign, 8 exponent, 13 mantissa bits) in an FP32 register.

This is the ISCA paper's description (32 products aligned to the largest exponent, highest 13
fraction bits kept, FP22 accumulator) with the accumulator as one more addend. The V3 report words
the truncation as a *sign-fill* right shift, which on two's-complement values rounds toward minus
infinity (``product_rounding="floor"``); the bit-accurate models do not, so that is an option, as
are the other open readings: products-only alignment, the product's own leading bit as its
exponent, rounding into FP22, other bit counts. The V3 recipe's remedy, promotion, adds the narrow
partial sum into an FP32 register every ``N_C`` products and restarts it from zero.

Everything works on a batch of independent dot products (float64 numpy: exact for the FP8 and BF16
products, shifts and short sums involved), so a 64x64 matrix product with K = 16384 takes a few
seconds on one core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv3.errors import DSV3Error

HOPPER_FRACTION_BITS = 13
HOPPER_GROUP = 32  # products aligned together: one FP8 wgmma's K
E4M3_MIN_EXPONENT = -6  # E4M3 subnormals are 0.f x 2**-6: the adder gives them exponent -6
PRODUCT_ROUNDINGS = ("toward_zero", "floor")  # sign-magnitude truncation vs two's-complement shift
REGISTER_ROUNDINGS = ("truncate", "nearest")  # how the aligned sum is stored into FP22
PRODUCT_EXPONENTS = ("operands", "product")  # a product's alignment exponent: e_a + e_b, or its own


@dataclass(frozen=True)
class Accumulator:
    """One reading of the tensor core's adder; the defaults are the bit-accurate Hopper FP8 model.

    ``fraction_bits``: bits kept below the alignment exponent and in the FP22 mantissa (13).
    ``group``: products per instruction, aligned together (32, one FP8 wgmma's K).
    ``align_with_accumulator``: the running sum is one more addend of the aligned adder (True), or
    the 32 products are aligned and summed alone and the sum is added to it (False).
    ``product_rounding``: how aligned terms lose their low bits: ``toward_zero`` (MMA-Sim, Khattak &
    Mikaitis) or ``floor`` (the V3 report's sign-fill shift read as two's complement).
    ``register_rounding``: how the sum is stored into FP22: ``truncate`` (toward zero, both models)
    or ``nearest``.
    ``product_exponent``: a product's alignment exponent, ``operands`` (e_a + e_b, both models) or
    ``product`` (the leading bit of the product itself, one higher when its significand is >= 2).
    """

    fraction_bits: int = HOPPER_FRACTION_BITS
    group: int = HOPPER_GROUP
    align_with_accumulator: bool = True
    product_rounding: str = "toward_zero"
    register_rounding: str = "truncate"
    product_exponent: str = "operands"

    def __post_init__(self) -> None:
        if not 1 <= self.fraction_bits <= 40:
            raise DSV3Error(f"fraction bits must lie in 1..40, got {self.fraction_bits}")
        if self.group < 1:
            raise DSV3Error(f"group must be positive, got {self.group}")
        if self.product_rounding not in PRODUCT_ROUNDINGS:
            raise DSV3Error(f"product rounding must be one of {PRODUCT_ROUNDINGS}, got {self.product_rounding!r}")
        if self.register_rounding not in REGISTER_ROUNDINGS:
            raise DSV3Error(f"register rounding must be one of {REGISTER_ROUNDINGS}, got {self.register_rounding!r}")
        if self.product_exponent not in PRODUCT_EXPONENTS:
            raise DSV3Error(f"product exponent must be one of {PRODUCT_EXPONENTS}, got {self.product_exponent!r}")


def to_grid(values: np.ndarray, quantum: np.ndarray, mode: str) -> np.ndarray:
    """Round ``values`` to multiples of ``quantum`` (a power of two): floor, toward zero or nearest-even."""
    scaled = values / quantum  # exact: quantum is a power of two
    if mode == "floor":
        return np.floor(scaled) * quantum
    if mode in ("toward_zero", "truncate"):
        return np.trunc(scaled) * quantum
    if mode == "nearest":
        return np.rint(scaled) * quantum
    raise DSV3Error(f"unknown rounding mode {mode!r}")


def truncate_to_grid(values: np.ndarray, quantum: np.ndarray) -> np.ndarray:
    """Drop every bit below ``quantum`` (a power of two), rounding toward zero."""
    return to_grid(values, quantum, "toward_zero")


def leading_weight(values: np.ndarray, min_exponent: int | None = None) -> np.ndarray:
    """Elementwise 2**floor(log2 |v|) (0 for 0): the weight of each value's leading bit.

    With ``min_exponent``, values below 2**min_exponent (the format's subnormals) get 2**min_exponent,
    as the hardware reads a subnormal as 0.f x 2**emin.
    """
    values = np.asarray(values, dtype=np.float64)
    _, exponent = np.frexp(values)  # |v| in [2**(e-1), 2**e)
    weight = np.ldexp(1.0, exponent - 1)
    if min_exponent is not None:
        weight = np.maximum(weight, 2.0**min_exponent)
    return np.where(values != 0, weight, 0.0)


def leading_bit(values: np.ndarray) -> np.ndarray:
    """2**floor(log2 |v|) of the last axis's largest magnitude (1 where the row is all zero)."""
    top = np.abs(values).max(axis=-1)
    _, exponent = np.frexp(np.where(top > 0, top, 1.0))  # top in [2**(e-1), 2**e)
    return np.ldexp(1.0, exponent - 1)


def round_to_narrow(values: np.ndarray, fraction_bits: int, mode: str = "truncate") -> np.ndarray:
    """Store in a float with ``fraction_bits`` mantissa bits (FP22 for 13)."""
    quantum = leading_bit(values[..., None]) * 2.0**-fraction_bits
    return to_grid(values, quantum, mode)


def alignment_weights(terms: np.ndarray, factor_weights: np.ndarray, acc: Accumulator) -> np.ndarray:
    """Each product's alignment weight 2**e.

    ``factor_weights`` is the product of its factors' leading-bit weights, 2**(e_a + e_b): the weight
    for ``product_exponent="operands"``; ``"product"`` takes the product's own leading bit instead.
    """
    if acc.product_exponent == "operands":
        return factor_weights
    return leading_weight(terms)


def mma_step(narrow: np.ndarray, terms: np.ndarray, weights: np.ndarray, acc: Accumulator) -> np.ndarray:
    """One MMA: add ``terms: [T, G]`` (exact products) into the FP22 accumulator ``narrow: [T]``.

    ``weights: [T, G]`` are the products' alignment weights 2**e (0 for zero products): the window
    is ``fraction_bits`` below the largest of them (and of the accumulator's leading bit when it
    joins the alignment).
    """
    top = weights.max(axis=1)
    if acc.align_with_accumulator:
        top = np.maximum(top, leading_weight(narrow))
    quantum = (np.where(top > 0, top, 1.0) * 2.0**-acc.fraction_bits)[:, None]
    total = to_grid(terms, quantum, acc.product_rounding).sum(axis=1)  # exact: a few dozen bits
    if acc.align_with_accumulator:
        total = total + to_grid(narrow, quantum[:, 0], acc.product_rounding)
    else:
        total = total + narrow  # exact in float64: both have at most ~15 significant bits
    return round_to_narrow(total, acc.fraction_bits, acc.register_rounding)


def limited_dot(
    a: np.ndarray,
    b: np.ndarray,
    acc: Accumulator = Accumulator(),
    promote_every: int | None = None,
    min_exponent: int | None = E4M3_MIN_EXPONENT,
) -> np.ndarray:
    """Sum the products ``a * b`` (``a, b: [T, K]``) along K as the emulated tensor core does; returns [T].

    The factors, not just the products, are needed: the adder aligns a product by the sum of its
    factors' exponents (``min_exponent``: the input format's, for subnormals; None for none).
    ``promote_every`` (N_C, a multiple of the group) adds the narrow partial sum into an FP32
    accumulator every N_C products, as the V3 recipe does; ``None`` accumulates all of K narrowly.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape:
        raise DSV3Error(f"a and b must both be [trials, K], got shapes {a.shape} and {b.shape}")
    wa, wb = leading_weight(a, min_exponent), leading_weight(b, min_exponent)
    state = PromotedSum(a.shape[0], acc, promote_every)
    for start in range(0, a.shape[1], acc.group):
        part = slice(start, start + acc.group)
        terms = a[:, part] * b[:, part]  # exact
        state.add(terms, alignment_weights(terms, wa[:, part] * wb[:, part], acc))
    return state.value()


class PromotedSum:
    """A narrow FP22 partial sum per output, flushed into FP32 every ``promote_every`` products."""

    def __init__(self, count: int, acc: Accumulator, promote_every: int | None) -> None:
        if promote_every is not None and (promote_every < acc.group or promote_every % acc.group):
            raise DSV3Error(f"promotion interval {promote_every} must be a positive multiple of the group {acc.group}")
        self.acc, self.promote_every, self.done = acc, promote_every, 0
        self.narrow = np.zeros(count)
        self.wide = np.zeros(count, dtype=np.float32)

    def add(self, terms: np.ndarray, weights: np.ndarray) -> None:
        """Feed the next group of products ``terms: [T, G]`` with their alignment weights (G = the group,
        shorter only at the end)."""
        self.narrow = mma_step(self.narrow, terms, weights, self.acc)
        self.done += terms.shape[1]
        if self.promote_every is not None and self.done % self.promote_every == 0:
            self.wide = self.wide + self.narrow.astype(np.float32)  # FP32 add on the CUDA cores
            self.narrow = np.zeros_like(self.narrow)

    def value(self) -> np.ndarray:
        """The result as the kernel writes it: any unpromoted remainder is added into FP32 too."""
        if self.promote_every is None:
            return self.narrow.copy()
        return (self.wide + self.narrow.astype(np.float32)).astype(np.float64)


def limited_matmul(
    a: np.ndarray,
    b: np.ndarray,
    ks: list[int],
    acc: Accumulator = Accumulator(),
    promote_every: int | None = None,
    min_exponent: int | None = E4M3_MIN_EXPONENT,
) -> dict[int, np.ndarray]:
    """``a: [M, K] @ b: [N, K]^T`` through the emulated accumulator, read out after each K in ``ks``.

    Each result ``[M, N]`` is the product of the first k columns, exactly as a GEMM with inner
    dimension k would compute it, so one pass over K = max(ks) yields every row of a K sweep.
    ``min_exponent`` as in :func:`limited_dot`.
    """
    m, k_total = a.shape
    if b.shape[1] != k_total:
        raise DSV3Error(f"a {a.shape} and b {b.shape} differ in K")
    if not ks or min(ks) < 1 or max(ks) > k_total or any(k % acc.group for k in ks):
        raise DSV3Error(f"every k must be a multiple of {acc.group} in 1..{k_total}, got {ks}")
    wa, wb = leading_weight(a, min_exponent), leading_weight(b, min_exponent)
    state = PromotedSum(m * b.shape[0], acc, promote_every)
    wanted, results = set(ks), {}
    for start in range(0, max(ks), acc.group):
        stop = start + acc.group
        terms = (a[:, None, start:stop] * b[None, :, start:stop]).reshape(-1, acc.group)  # [M*N, G], exact
        factor_weights = (wa[:, None, start:stop] * wb[None, :, start:stop]).reshape(-1, acc.group)
        state.add(terms, alignment_weights(terms, factor_weights, acc))
        if stop in wanted:
            results[stop] = state.value().reshape(m, b.shape[0])
    return results


# --------------------------------------------------------------------------------------------------
# Random operands and error measures
# --------------------------------------------------------------------------------------------------

DISTRIBUTIONS = ("normal", "abs-normal", "uniform", "uniform-symmetric")
INPUT_FORMATS = ("e4m3-tensor", "e4m3-raw", "e4m3-tile", "bf16")
ERROR_METRICS = ("normwise", "max-normalized", "elementwise", "componentwise")


def random_values(shape: tuple[int, int], dist: str, rng: np.random.Generator) -> np.ndarray:
    """Unquantized random matrix: N(0,1), |N(0,1)|, U[0,1) or U[-1,1)."""
    if dist == "normal":
        return rng.standard_normal(shape)
    if dist == "abs-normal":
        return np.abs(rng.standard_normal(shape))
    if dist == "uniform":
        return rng.random(shape)
    if dist == "uniform-symmetric":
        return rng.uniform(-1.0, 1.0, shape)
    raise DSV3Error(f"unknown input distribution {dist!r}; expected one of {DISTRIBUTIONS}")


def quantized_operand(x: np.ndarray, fmt: str, block: tuple[int, int]) -> np.ndarray:
    """``x: [R, K]`` as the GEMM sees it, in float64 (exactly representable products).

    ``e4m3-tensor``: raw E4M3 values under one per-tensor scale (the scale cancels from relative
    errors and is dropped). ``e4m3-raw``: the values cast to E4M3 as they are, no scale (a plain
    ``torch.randn(...).to(torch.float8_e4m3fn)``: small values fall into E4M3's subnormals).
    ``e4m3-tile``: E4M3 with the V3 tiling (``block``) and power-of-two scales, dequantized; an
    unpromoted tensor core cannot apply per-tile scales, so this asks what the narrow adder would do
    with the recipe's values. ``bf16``: values rounded to BF16.
    """
    import torch

    from dsv3.precision import fp8

    t = torch.from_numpy(x).float()
    if fmt == "e4m3-tensor":
        q, _ = fp8.quantize_per_tensor(t)
        return q.double().numpy()
    if fmt == "e4m3-raw":
        return t.to(torch.float8_e4m3fn).double().numpy()
    if fmt == "e4m3-tile":
        q, scale = fp8.quantize(t, block=block, pow2_scale=True)
        return fp8.dequantize(q, scale, block).double().numpy()  # exact: 4-bit values times 2**n
    if fmt == "bf16":
        return t.bfloat16().double().numpy()
    raise DSV3Error(f"unknown input format {fmt!r}; expected one of {INPUT_FORMATS}")


def random_operands(
    m: int, n: int, k: int, dist: str, fmt: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A [M, K] (activations: 1x128 tiles) and B [N, K] (weights: 128x128 blocks), quantized."""
    a = quantized_operand(random_values((m, k), dist, rng), fmt, (1, 128))
    b = quantized_operand(random_values((n, k), dist, rng), fmt, (128, 128))
    return a, b


def fp8_random(shape: tuple[int, int], dist: str, rng: np.random.Generator) -> np.ndarray:
    """Random E4M3 values with one scale per tensor, returned as the raw FP8 numbers (scale dropped)."""
    return quantized_operand(random_values(shape, dist, rng), "e4m3-tensor", (1, 128))


def matrix_error(approx: np.ndarray, exact: np.ndarray, a: np.ndarray, b: np.ndarray, metric: str) -> float:
    """Relative error of one product ``C' ~ C = a @ b.T``.

    ``normwise``: ||C' - C||_F / ||C||_F. ``elementwise``: max |C' - C| / |C| over the elements (blows
    up where a dot product nearly cancels). ``max-normalized``: max |C' - C| / max |C|.
    ``componentwise``: max |C' - C| / (|a| @ |b|.T).
    """
    diff = np.abs(approx - exact)
    if metric == "normwise":
        return float(np.linalg.norm(diff) / np.linalg.norm(exact))
    if metric == "max-normalized":
        return float(diff.max() / np.abs(exact).max())
    if metric == "elementwise":
        return float(np.max(diff / np.abs(exact)))
    if metric == "componentwise":
        return float(np.max(diff / (np.abs(a) @ np.abs(b).T)))
    raise DSV3Error(f"unknown error metric {metric!r}; expected one of {ERROR_METRICS}")


def relative_errors(
    k: int,
    trials: int,
    dist: str = "uniform",
    promote_every: int | None = None,
    seed: int = 0,
    acc: Accumulator = Accumulator(),
) -> np.ndarray:
    """|limited - exact| / |exact| for ``trials`` random per-tensor E4M3 dot products of length ``k``."""
    rng = np.random.default_rng(seed)
    a, b = fp8_random((trials, k), dist, rng), fp8_random((trials, k), dist, rng)
    exact = (a * b).sum(axis=1)  # exact in float64: 8-bit significands, exponents -18..17
    approx = limited_dot(a, b, acc, promote_every)
    return np.abs(approx - exact) / np.abs(exact)
