"""LogFMT-n: the per-tile logarithmic n-bit format the paper proposes for the MoE combine (ISCA 2025 §3.2).

Every 1x128 tile along the last dimension stores one sign bit and an (n-1)-bit magnitude code per element.
Code 0 is zero; codes 1..top are `exp2((code - 1) * step + log_min)`, evenly spaced in log2 between the
tile's smallest non-zero magnitude (clamped to 2^-32 of the max) and its largest. Each element goes to the
code whose DECODED value is nearest in linear space, which the paper chose so the rounding is unbiased.

Metadata is the tile's `(amax, amin)` in the input's own dtype (for BF16 input: the two BF16 values per tile
that DeepEP sends); encoder and decoder derive `log_min` and `step` from them with the same code, so
`decode(encode(x))` equals `quantize(x)` bit for bit. See docs/logfmt.md for the layout.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv3.errors import DSV3Error
from dsv3.layout import SIMULATED_COMBINE_FORMATS

TILE = 128
MIN_BITS, MAX_BITS = 4, 16
LOG2_RANGE = 32.0  # log_min >= log_max - 32: about the range of a 5-bit exponent (ISCA paper §3.2)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ROUNDINGS = ("linear", "log")
_INT_VIEW = {  # same-width integer views of each float dtype, for bit-level work
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_BLOCK_ELEMENTS = 1 << 17  # per cache block; float64 temporaries of one block stay in L2/L3
_GPU_BLOCK_ELEMENTS = 1 << 24  # on a GPU the per-block kernel launches and syncs dominate: few, large blocks


@dataclass(frozen=True)
class LogFMTPacked:
    """An encoded tensor: bit-packed codes plus per-tile metadata, enough to rebuild `quantize(x)` exactly."""

    payload: torch.Tensor  # uint8 [ceil(numel * bits / 8)]: element i's n-bit word at bit offset i * bits
    meta: torch.Tensor  # [rows, tiles, 2] in `dtype`: (amax, smallest non-zero |x|) of each tile
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    fallback_mask: torch.Tensor | None = None  # bool [rows, tiles]: tiles sent as BF16 instead
    fallback_values: torch.Tensor | None = None  # bf16 [n_fallback_tiles, 128] (partial tiles zero-padded)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_bytes(self) -> int:
        return self.payload.numel()

    @property
    def metadata_bytes(self) -> int:
        """Per-tile (amax, amin), plus one bit per tile for the fallback flag when fallback is on."""
        flags = 0 if self.fallback_mask is None else (self.fallback_mask.numel() + 7) // 8
        return self.meta.numel() * self.meta.element_size() + flags

    @property
    def fallback_bytes(self) -> int:
        values = self.fallback_values
        return 0 if values is None else values.numel() * values.element_size()

    @property
    def nbytes(self) -> int:
        return self.payload_bytes + self.metadata_bytes + self.fallback_bytes

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / max(self.numel, 1)


def quantize(x: torch.Tensor, bits: int, *, fallback: bool = False, rounding: str = "linear") -> torch.Tensor:
    """LogFMT-`bits` round trip of `x`: the decoded values, same shape and dtype.

    `fallback=True` keeps a tile in BF16 unless its max is below 1 and it spans more than one magnitude
    (DeepEP's rule). `rounding="log"` rounds to the nearest code in log space: the biased variant the paper
    argues against, kept for comparison only.
    """
    _check(x, bits, rounding)
    if x.numel() == 0:
        return x.clone()
    rows = _rows(x)  # [R, D]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    for start, stop in _row_blocks(*rows.shape, x.device):
        tiles = _tiles(rows[start:stop])  # [r, T, 128]
        meta = _tile_meta(tiles)
        log_min, step = _log_scales(meta, bits)
        codes = _magnitude_codes(tiles, log_min, step, bits, rounding)
        values = torch.copysign(_magnitudes(codes, log_min, step).to(x.dtype), tiles)
        if fallback:
            keep_bf16 = _fallback_tiles(meta, step).unsqueeze(-1)
            values = torch.where(keep_bf16, tiles.to(torch.bfloat16).to(x.dtype), values)
        out[start:stop] = _untile(values, rows.shape[1])
    return out.view(x.shape)


def encode(x: torch.Tensor, bits: int, *, fallback: bool = False, rounding: str = "linear") -> LogFMTPacked:
    """Pack `x` into `ceil(numel * bits / 8)` payload bytes plus per-tile metadata (see `quantize`)."""
    _check(x, bits, rounding)
    shape = tuple(x.shape)
    rows = _rows(x)
    n_rows, width = rows.shape
    meta = torch.empty(n_rows, -(-width // TILE), 2, dtype=x.dtype, device=x.device)
    payload = torch.empty((x.numel() * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    masks, fallback_values = [], []
    for start, stop in _row_blocks(n_rows, width, x.device):
        tiles = _tiles(rows[start:stop])
        meta[start:stop] = block_meta = _tile_meta(tiles)
        log_min, step = _log_scales(block_meta, bits)
        words = _magnitude_codes(tiles, log_min, step, bits, rounding).to(torch.int64)
        words |= torch.signbit(tiles).to(torch.int64) << (bits - 1)
        if fallback:
            masks.append(mask := _fallback_tiles(block_meta, step))
            words.masked_fill_(mask.unsqueeze(-1), 0)
            fallback_values.append(tiles[mask].to(torch.bfloat16))
        packed = _pack(_untile(words, width).reshape(-1), bits)
        first_byte = start * width * bits // 8  # exact: blocks start at a multiple of 8 rows
        payload[first_byte : first_byte + packed.numel()] = packed
    if not fallback:
        return LogFMTPacked(payload, meta, shape, x.dtype, bits)
    mask = torch.cat(masks) if masks else torch.zeros(meta.shape[:2], dtype=torch.bool, device=x.device)
    values = torch.cat(fallback_values) if fallback_values else meta.new_zeros(0, TILE, dtype=torch.bfloat16)
    return LogFMTPacked(payload, meta, shape, x.dtype, bits, mask, values)


def decode(packed: LogFMTPacked) -> torch.Tensor:
    """Rebuild the tensor from `encode`'s output; equals `quantize(x, bits)` bit for bit."""
    bits, n_rows, width = packed.bits, *_rows_shape(packed.shape)
    _check_packed(packed, n_rows, width)
    out = torch.empty(n_rows, width, dtype=packed.dtype, device=packed.payload.device)
    used_fallback = 0
    for start, stop in _row_blocks(n_rows, width, out.device):
        first, last = start * width * bits // 8, -(-stop * width * bits // 8)
        words = _tiles(_unpack(packed.payload[first:last], bits, (stop - start) * width).view(-1, width))
        meta = packed.meta[start:stop]
        log_min, step = _log_scales(meta, bits)
        codes = (words & ((1 << (bits - 1)) - 1)).to(torch.float64)
        values = _set_sign_bits(_magnitudes(codes, log_min, step).to(packed.dtype), words, bits)
        if packed.fallback_mask is not None:
            mask = packed.fallback_mask[start:stop]
            count = int(mask.sum())
            values[mask] = packed.fallback_values[used_fallback : used_fallback + count].to(packed.dtype)
            used_fallback += count
        out[start:stop] = _untile(values, width)
    return out.view(packed.shape)


def _check_packed(packed: LogFMTPacked, n_rows: int, width: int) -> None:
    """Refuse a packed object whose parts disagree in size, rather than decode garbage."""
    _check(torch.zeros(0, dtype=packed.dtype), packed.bits)
    expected = (packed.numel * packed.bits + 7) // 8
    if packed.payload.dtype != torch.uint8 or packed.payload.numel() != expected:
        raise DSV3Error(f"LogFMT payload has {packed.payload.numel()} bytes, expected {expected}")
    meta_shape = (n_rows, -(-width // TILE), 2)
    if tuple(packed.meta.shape) != meta_shape:
        raise DSV3Error(f"LogFMT metadata has shape {tuple(packed.meta.shape)}, expected {meta_shape}")


def representable_values(log_min: float, step: float, bits: int) -> torch.Tensor:
    """All non-negative magnitudes of one tile, code 0 first: float64 [2^(bits-1)]. For tests and docs."""
    codes = torch.arange(1 << (bits - 1), dtype=torch.float64)
    return _magnitudes(codes, torch.tensor(log_min, dtype=torch.float64), torch.tensor(step, dtype=torch.float64))


# --- tiles and their scales -------------------------------------------------------------------------------


def _check(x: torch.Tensor, bits: int, rounding: str = "linear") -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise DSV3Error(f"LogFMT bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise DSV3Error(f"LogFMT needs a bfloat16, float16, float32 or float64 tensor, got {got}")
    if rounding not in ROUNDINGS:
        raise DSV3Error(f"LogFMT rounding must be one of {ROUNDINGS}, got {rounding!r}")


def _rows_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, last dim) of a tensor of `shape`; a 0-d tensor is one row of one element."""
    width = shape[-1] if len(shape) else 1
    return (math.prod(shape) // width if width else 0), width


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> [R, D]; tiles run along D."""
    return x.reshape(_rows_shape(tuple(x.shape)))


def _row_blocks(n_rows: int, width: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """Row ranges of about _BLOCK_ELEMENTS elements (many more on a GPU), a multiple of 8 rows each so every
    block but the last fills whole payload bytes. Cache blocking only: each block holds many tiles."""
    size = _BLOCK_ELEMENTS if device.type == "cpu" else _GPU_BLOCK_ELEMENTS
    step = max(8, size // max(width, 1) // 8 * 8)
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def _tiles(rows: torch.Tensor) -> torch.Tensor:
    """[r, D] -> [r, ceil(D/128), 128]; the last tile is zero-padded (zeros change neither amax nor amin)."""
    pad = (-rows.shape[1]) % TILE
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, TILE)


def _untile(tiles: torch.Tensor, width: int) -> torch.Tensor:
    """[r, T, 128] -> [r, width], dropping the padding of the last tile."""
    rows = tiles.reshape(tiles.shape[0], -1)
    return rows[:, :width] if rows.shape[1] != width else rows


def _tile_meta(tiles: torch.Tensor) -> torch.Tensor:
    """[r, T, 128] -> [r, T, 2] in the input dtype: (max |x|, smallest non-zero |x| or 0); refuses inf/nan.

    Works on IEEE bit patterns: with the sign bit cleared they order like the magnitudes, and `bits - 1`
    wrapped into the positive range sends zero to the top, so one integer min finds the smallest non-zero.
    """
    int_dtype = _INT_VIEW[tiles.dtype]
    positive = torch.iinfo(int_dtype).max
    magnitude_bits = tiles.view(int_dtype) & positive
    amax = magnitude_bits.amax(-1)
    if bool((amax >= _inf_bits(tiles.dtype)).any()):
        raise DSV3Error("LogFMT cannot encode inf or nan; the input has non-finite values")
    amin = (((magnitude_bits - 1) & positive).amin(-1) + 1) & positive
    return torch.stack([amax, amin], -1).view(tiles.dtype)


def _inf_bits(dtype: torch.dtype) -> int:
    """The bit pattern of +inf: every finite magnitude's pattern is below it, inf and nan are not."""
    return int(torch.tensor(math.inf, dtype=dtype).view(_INT_VIEW[dtype]).item())


def _log_scales(meta: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile float64 (log_min, step), each [R, T, 1]; an all-zero tile gets (0, 0)."""
    amax, amin = meta.to(torch.float64).unbind(-1)
    log_max = torch.log2(amax)
    log_min = torch.maximum(torch.log2(amin), log_max - LOG2_RANGE)
    empty = amax == 0
    log_max, log_min = log_max.masked_fill(empty, 0.0), log_min.masked_fill(empty, 0.0)
    step = (log_max - log_min) / ((1 << (bits - 1)) - 2)
    return log_min.unsqueeze(-1), step.unsqueeze(-1)


def _fallback_tiles(meta: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """DeepEP's rule: LogFMT only where amax < 1 and log_min < log_max; other tiles go as BF16. [R, T] bool."""
    return ~((meta[..., 0] < 1) & (step.squeeze(-1) > 0))


# --- rounding and decoding --------------------------------------------------------------------------------


def _magnitude_codes(
    tiles: torch.Tensor, log_min: torch.Tensor, step: torch.Tensor, bits: int, rounding: str
) -> torch.Tensor:
    """Codes 0..2^(bits-1)-1 of |x| (float64, [r, T, 128]), nearest decoded value in linear space.

    Between levels k and k+1 the linear threshold is their arithmetic mean, which sits `mid` above level k
    in log2 with mid = log2((1 + 2^step) / 2); so code = floor((log2|x| - log_min - mid) / step) + 2.
    Between 0 and the min level the threshold is exp2(log_min) / 2, i.e. log_min - 1 in log2.
    In float64 the thresholds are exact to ~1e-15, so only true ties can go either way.
    """
    top = (1 << (bits - 1)) - 1
    flat = step == 0  # all-zero tile, or one magnitude only: t = log2|x| - log_min + 1.5 gives codes 0 and 1
    safe = step.masked_fill(flat, 1.0)
    mid = torch.log2((1 + torch.exp2(safe)) / 2) if rounding == "linear" else safe / 2
    mid.masked_fill_(flat, 0.5)
    inverse = safe.reciprocal()
    offset = 2 - (mid + log_min) * inverse
    log_magnitude = tiles.to(torch.float64, copy=True).abs_().log2_()
    torch.maximum(log_magnitude, log_min - 2, out=log_magnitude)  # zeros (-inf) and tiny values: code 0
    codes = torch.addcmul(offset, log_magnitude, inverse).floor_().clamp_(0, top)
    # Only a tile whose range hit the 2^-32 clamp holds values below exp2(log_min); elsewhere the closed
    # form already puts every non-zero at code >= 1. There, round to 0 or the min code by linear midpoint.
    if bool((step * (top - 1) > LOG2_RANGE - 0.5).any()):
        torch.maximum(codes, log_magnitude >= log_min - 1, out=codes)
    return codes


def _magnitudes(codes: torch.Tensor, log_min: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Decode float64 codes to float64 magnitudes: 0 for code 0, else exp2((code - 1) * step + log_min)."""
    values = torch.addcmul(log_min - step, codes, step).exp2_()
    return values.mul_(codes.clamp(max=1))


def _set_sign_bits(values: torch.Tensor, words: torch.Tensor, bits: int) -> torch.Tensor:
    """Copy each word's sign bit into the IEEE sign bit of the non-negative `values` (in place)."""
    int_dtype = _INT_VIEW[values.dtype]
    sign = (words >> (bits - 1)) << (torch.iinfo(int_dtype).bits - 1)
    values.view(int_dtype).bitwise_or_(sign.to(int_dtype))
    return values


# --- bit packing ------------------------------------------------------------------------------------------
# Element i's word (sign << (bits-1) | code) occupies payload bits [i*bits, (i+1)*bits), least significant
# bit first: the smallest group of g words that fills whole bytes is packed into one or two little-endian
# int64 lanes, then cut to its g*bits/8 bytes. The last byte is zero-padded when numel*bits % 8 != 0.


def _group(bits: int) -> tuple[int, int]:
    """(words per group, bytes per group): the fewest words whose bits fill whole bytes."""
    words = 8 // math.gcd(bits, 8)
    return words, words * bits // 8


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise DSV3Error("LogFMT bit packing assumes a little-endian machine")


def _pack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 words [N] (each < 2^bits) -> uint8 [ceil(N * bits / 8)]."""
    _require_little_endian()
    n = words.numel()
    if bits == 8:
        return words.to(torch.uint8)
    if bits == 16:
        return words.to(torch.int16).view(torch.uint8)
    group, group_bytes = _group(bits)
    words = F.pad(words, (0, (-n) % group)).view(-1, group)  # [G, g]
    lanes = words.new_zeros(words.shape[0], 2 if group * bits > 64 else 1)
    low = lanes[:, 0]
    # One pass per word position (g <= 8), each over every group at once: measured faster on CPU than a
    # broadcast shift-and-sum over [G, g].
    for offset, word in zip(range(0, group * bits, bits), words.unbind(1), strict=True):
        if offset < 64:
            low |= word << offset  # bits past 63 fall off here and go to the high lane below
        if offset + bits > 64:
            lanes[:, 1] |= word << (offset - 64) if offset >= 64 else word >> (64 - offset)
    packed = lanes.view(torch.uint8)[:, :group_bytes]  # little-endian lanes: lowest bits first
    return packed.reshape(-1)[: (n * bits + 7) // 8]


def _unpack(payload: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [ceil(n * bits / 8)] -> int64 words [n]; inverse of `_pack`."""
    _require_little_endian()
    if bits == 8:
        return payload.to(torch.int64)
    if bits == 16:
        return payload.view(torch.int16).to(torch.int64) & 0xFFFF
    group, group_bytes = _group(bits)
    n_groups = -(-n // group)
    raw = payload.new_zeros(n_groups, 16 if group * bits > 64 else 8)
    raw[:, :group_bytes] = F.pad(payload, (0, n_groups * group_bytes - payload.numel())).view(n_groups, -1)
    lanes = raw.view(torch.int64)  # [G, 1 or 2]
    low, mask = lanes[:, 0], (1 << bits) - 1
    words = torch.empty(n_groups, group, dtype=torch.int64, device=payload.device)
    for offset, word in zip(range(0, group * bits, bits), words.unbind(1), strict=True):
        if offset + bits <= 64:
            torch.bitwise_and(low >> offset, mask, out=word)
        elif offset >= 64:
            torch.bitwise_and(lanes[:, 1] >> (offset - 64), mask, out=word)
        else:  # the word straddles the lanes; >> sign-extends, so mask the low part to its own bits
            low_part = (low >> offset) & ((1 << (64 - offset)) - 1)
            torch.bitwise_or(low_part, (lanes[:, 1] << (64 - offset)) & mask, out=word)
    return words.view(-1)[:n]


# --- simulating the combine in each candidate format ------------------------------------------------------

COMBINE_FORMATS = SIMULATED_COMBINE_FORMATS  # ("bf16", "e4m3", "e5m2", "logfmt8", "logfmt10")
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_tile_round_trip(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Cast to FP8 with one amax scale per 1x128 tile (the paper's activation recipe) and back to x.dtype."""
    rows = _rows(x)
    tiles = _tiles(rows).to(torch.float32)
    amax = tiles.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.finfo(fp8_dtype).max, torch.ones_like(amax))
    out = (tiles / scale).to(fp8_dtype).to(torch.float32) * scale
    return _untile(out, rows.shape[1]).reshape(x.shape).to(x.dtype)


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x sent through the combine in format `fmt` (one of COMBINE_FORMATS), back in x.dtype."""
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if fmt in _FP8:
        return fp8_tile_round_trip(x, _FP8[fmt])
    if fmt in ("logfmt8", "logfmt10"):
        return quantize(x, int(fmt.removeprefix("logfmt")))
    raise DSV3Error(f"unknown combine format {fmt!r}; choose one of {', '.join(COMBINE_FORMATS)}")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return round_trip(x.detach(), fmt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def quantize_moe_output(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Simulate the MoE combine in `fmt`: forward is the format's round trip, backward is the identity."""
    if fmt not in COMBINE_FORMATS:
        raise DSV3Error(f"unknown combine format {fmt!r}; choose one of {', '.join(COMBINE_FORMATS)}")
    return _StraightThrough.apply(x, fmt)
