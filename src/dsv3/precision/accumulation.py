"""Emulate a tensor core's limited-precision accumulation, with and without promotion to FP32.

The ISCA paper describes Hopper's FP8 MMA: 32 products are aligned by right-shifting to the largest
exponent, only the highest 13 fraction bits are kept (the rest truncated), and results are accumulated
in FP22 registers (1 sign, 8 exponent, 13 mantissa bits). The V3 report adds that the right shift is a
*sign-fill* shift: the aligned products are two's-complement integers, so dropping their low bits
rounds toward minus infinity (``product_rounding="floor"``), not toward zero. Open details are
options: whether the running accumulator joins the alignment as one more addend, how the sum is
rounded into FP22, how many bits are kept. The V3 recipe's remedy, promotion, adds the narrow partial
sum into an FP32 register every ``N_C`` products and restarts it from zero.

Everything works on a batch of independent dot products (float64 numpy: exact for the FP8 and BF16
products, shifts and short sums involved), so a 64x64 matrix product with K = 16384 takes under two seconds on one core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv3.errors import DSV3Error

HOPPER_FRACTION_BITS = 13
HOPPER_GROUP = 32  # products aligned together: one WGMMA's K for FP8
PRODUCT_ROUNDINGS = ("floor", "toward_zero")  # two's-complement shift vs sign-magnitude shift
REGISTER_ROUNDINGS = ("truncate", "nearest")  # how the aligned sum is stored into FP22


@dataclass(frozen=True)
class Accumulator:
    """One reading of the tensor core's adder.

    Defaults: 13 fraction bits (ISCA), 32 products per alignment (one FP8 WGMMA's K), the FP22
    accumulator as one more addend of the aligned adder (as Fasi et al. measured on earlier NVIDIA
    tensor cores), two's-complement truncation of the shifted products (the V3 report's sign-fill
    shift) and truncation into FP22 (SageAttention2 observed the low 10 FP32 bits zeroed).
    """

    fraction_bits: int = HOPPER_FRACTION_BITS
    group: int = HOPPER_GROUP
    align_with_accumulator: bool = True
    product_rounding: str = "floor"
    register_rounding: str = "truncate"

    def __post_init__(self) -> None:
        if not 1 <= self.fraction_bits <= 40:
            raise DSV3Error(f"fraction bits must lie in 1..40, got {self.fraction_bits}")
        if self.group < 1:
            raise DSV3Error(f"group must be positive, got {self.group}")
        if self.product_rounding not in PRODUCT_ROUNDINGS:
            raise DSV3Error(f"product rounding must be one of {PRODUCT_ROUNDINGS}, got {self.product_rounding!r}")
        if self.register_rounding not in REGISTER_ROUNDINGS:
            raise DSV3Error(f"register rounding must be one of {REGISTER_ROUNDINGS}, got {self.register_rounding!r}")


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


def leading_bit(values: np.ndarray) -> np.ndarray:
    """2**floor(log2 |v|) along the last axis's maximum: the weight of the largest term's leading bit."""
    top = np.abs(values).max(axis=-1)
    _, exponent = np.frexp(np.where(top > 0, top, 1.0))  # top in [2**(e-1), 2**e)
    return np.ldexp(1.0, exponent - 1)


def round_to_narrow(values: np.ndarray, fraction_bits: int, mode: str = "truncate") -> np.ndarray:
    """Store in a float with ``fraction_bits`` mantissa bits (FP22 for 13)."""
    quantum = leading_bit(values[..., None]) * 2.0**-fraction_bits
    return to_grid(values, quantum, mode)


def mma_step(narrow: np.ndarray, terms: np.ndarray, acc: Accumulator) -> np.ndarray:
    """One MMA: add ``terms: [T, G]`` (exact products) into the FP22 accumulator ``narrow: [T]``."""
    if acc.align_with_accumulator:
        terms = np.concatenate([narrow[:, None], terms], axis=1)
    quantum = leading_bit(terms)[:, None] * 2.0**-acc.fraction_bits
    total = to_grid(terms, quantum, acc.product_rounding).sum(axis=1)  # exact: a few dozen bits
    if not acc.align_with_accumulator:
        total = total + narrow  # exact in float64: both have at most ~14 significant bits
    return round_to_narrow(total, acc.fraction_bits, acc.register_rounding)


def limited_dot(
    products: np.ndarray,
    fraction_bits: int = HOPPER_FRACTION_BITS,
    group: int = HOPPER_GROUP,
    promote_every: int | None = None,
    align_with_accumulator: bool = True,
    product_rounding: str = "floor",
    register_rounding: str = "truncate",
) -> np.ndarray:
    """Sum ``products: [T, K]`` (exact products) as the emulated tensor core does; returns [T].

    ``promote_every`` (N_C, a multiple of ``group``) adds the narrow partial sum into an FP32
    accumulator every N_C products, as the V3 recipe does; ``None`` accumulates all of K narrowly.
    """
    products = np.asarray(products, dtype=np.float64)
    if products.ndim != 2:
        raise DSV3Error(f"products must be [trials, K], got shape {products.shape}")
    acc = Accumulator(fraction_bits, group, align_with_accumulator, product_rounding, register_rounding)
    state = PromotedSum(products.shape[0], acc, promote_every)
    for start in range(0, products.shape[1], group):
        state.add(products[:, start : start + group])
    return state.value()


class PromotedSum:
    """A narrow FP22 partial sum per output, flushed into FP32 every ``promote_every`` products."""

    def __init__(self, count: int, acc: Accumulator, promote_every: int | None) -> None:
        if promote_every is not None and (promote_every < acc.group or promote_every % acc.group):
            raise DSV3Error(f"promotion interval {promote_every} must be a positive multiple of the group {acc.group}")
        self.acc, self.promote_every, self.done = acc, promote_every, 0
        self.narrow = np.zeros(count)
        self.wide = np.zeros(count, dtype=np.float32)

    def add(self, terms: np.ndarray) -> None:
        """Feed the next group of products ``terms: [T, G]`` (G = the group, shorter only at the end)."""
        self.narrow = mma_step(self.narrow, terms, self.acc)
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
) -> dict[int, np.ndarray]:
    """``a: [M, K] @ b: [N, K]^T`` through the emulated accumulator, read out after each K in ``ks``.

    Each result ``[M, N]`` is the product of the first k columns, exactly as a GEMM with inner
    dimension k would compute it, so one pass over K = max(ks) yields every row of a K sweep.
    """
    m, k_total = a.shape
    if b.shape[1] != k_total:
        raise DSV3Error(f"a {a.shape} and b {b.shape} differ in K")
    if not ks or min(ks) < 1 or max(ks) > k_total or any(k % acc.group for k in ks):
        raise DSV3Error(f"every k must be a multiple of {acc.group} in 1..{k_total}, got {ks}")
    state = PromotedSum(m * b.shape[0], acc, promote_every)
    wanted, results = set(ks), {}
    for start in range(0, max(ks), acc.group):
        stop = start + acc.group
        terms = a[:, None, start:stop] * b[None, :, start:stop]  # [M, N, G], exact
        state.add(terms.reshape(-1, acc.group))
        if stop in wanted:
            results[stop] = state.value().reshape(m, b.shape[0])
    return results


# --------------------------------------------------------------------------------------------------
# Random operands and error measures
# --------------------------------------------------------------------------------------------------

DISTRIBUTIONS = ("normal", "abs-normal", "uniform", "uniform-symmetric")
INPUT_FORMATS = ("e4m3-tensor", "e4m3-tile", "bf16")
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
    errors and is dropped). ``e4m3-tile``: E4M3 with the V3 tiling (``block``) and power-of-two
    scales, dequantized; an unpromoted tensor core cannot apply per-tile scales, so this asks what the
    narrow adder would do with the recipe's values. ``bf16``: values rounded to BF16.
    """
    import torch

    from dsv3.precision import fp8

    t = torch.from_numpy(x).float()
    if fmt == "e4m3-tensor":
        q, _ = fp8.quantize_per_tensor(t)
        return q.double().numpy()
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
    **kwargs,
) -> np.ndarray:
    """|limited - exact| / |exact| for ``trials`` random per-tensor E4M3 dot products of length ``k``."""
    rng = np.random.default_rng(seed)
    a, b = fp8_random((trials, k), dist, rng), fp8_random((trials, k), dist, rng)
    products = a * b  # exact in float64
    exact = products.sum(axis=1)  # exact too: 8-bit significands, exponents -18..17
    approx = limited_dot(products, promote_every=promote_every, **kwargs)
    return np.abs(approx - exact) / np.abs(exact)
