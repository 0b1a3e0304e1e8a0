"""Wire formats: how a block of rows [R, D] becomes bytes [R, row_bytes] for an all-to-all, and back.

Every format packs each row into the same number of bytes, so rows can be split by destination, gathered
and forwarded as raw bytes (the FP8 dispatch is forwarded within the node without re-quantizing, as in
DeepEP), and the traffic of a send is simply rows x row_bytes.

- ``fp32``: exact; used by tests to check the plumbing bit for bit.
- ``bf16``: 2 bytes per value.
- ``fp8``: E4M3 with one power-of-2 (UE8M0-valued) fp32 scale per 1x128 tile: D + 4*ceil(D/128) bytes,
  V3's dispatch format (DeepEP sends the same).
- ``logfmt8`` / ``logfmt10``: LogFMT-n of the BF16 values, n bits per value plus a BF16 (amax, amin) pair
  per 1x128 tile: D*n/8 + 4*ceil(D/128) bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv3.errors import DSV3Error
from dsv3.layout import COMBINE_FORMATS, DISPATCH_FORMATS  # noqa: F401 - the wire formats' names live with the layout
from dsv3.precision import fp8, logfmt

TILE = 128


@dataclass(frozen=True)
class WireFormat:
    """One row codec. ``encode(x [R, D]) -> uint8 [R, row_bytes(D)]``; ``decode`` inverts it (lossy)."""

    name: str

    def row_bytes(self, dim: int) -> int:
        tiles = math.ceil(dim / TILE)
        if self.name == "fp32":
            return 4 * dim
        if self.name == "bf16":
            return 2 * dim
        if self.name == "fp8":
            return dim + 4 * tiles
        return dim * self.bits // 8 + 4 * tiles

    @property
    def bits(self) -> int:
        return int(self.name.removeprefix("logfmt"))

    def check(self, dim: int) -> None:
        if self.name.startswith("logfmt") and dim * self.bits % 8:
            raise DSV3Error(
                f"{self.name} packs whole bytes per row: hidden size {dim} x {self.bits} bits "
                "is not a multiple of 8"
            )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        if rows == 0:
            return torch.empty(0, self.row_bytes(dim), dtype=torch.uint8, device=x.device)
        if self.name == "fp32":
            return _bytes(x.float())
        if self.name == "bf16":
            return _bytes(x.to(torch.bfloat16))
        if self.name == "fp8":
            q, scale = fp8.quantize(x, block=(1, TILE), fmt="e4m3", pow2_scale=True)
            return torch.cat([q.view(torch.uint8), _bytes(scale)], dim=1)
        packed = logfmt.encode(x.to(torch.bfloat16), self.bits)
        return torch.cat([packed.payload.view(rows, -1), _bytes(packed.meta.reshape(rows, -1))], dim=1)

    def decode(self, data: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        rows = data.shape[0]
        if rows == 0:
            return torch.empty(0, dim, dtype=dtype, device=data.device)
        data = data.contiguous()
        if self.name == "fp32":
            return data.view(torch.float32).to(dtype)
        if self.name == "bf16":
            return data.view(torch.bfloat16).to(dtype)
        if self.name == "fp8":
            q = data[:, :dim].contiguous().view(torch.float8_e4m3fn)
            scale = data[:, dim:].contiguous().view(torch.float32)
            return fp8.dequantize(q, scale, (1, TILE), dtype=dtype)
        payload_bytes = dim * self.bits // 8
        meta = data[:, payload_bytes:].contiguous().view(torch.bfloat16).view(rows, -1, 2)
        packed = logfmt.LogFMTPacked(
            data[:, :payload_bytes].reshape(-1), meta, (rows, dim), torch.bfloat16, self.bits
        )
        return logfmt.decode(packed).to(dtype)


def wire_format(name: str, allowed: tuple[str, ...]) -> WireFormat:
    if name not in allowed:
        raise DSV3Error(f"unknown wire format {name!r}; expected one of {', '.join(allowed)}")
    return WireFormat(name)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """[R, C] of any dtype -> its bytes as uint8 [R, C * itemsize]."""
    return x.contiguous().view(torch.uint8)


def pack_fields(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-row byte blocks [R, b_i] into one [R, sum b_i] send buffer."""
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def raw_bytes(x: torch.Tensor) -> torch.Tensor:
    """A raw (uncompressed) per-row field, e.g. gate weights fp32 [R, K], as bytes."""
    return _bytes(x)


def from_raw(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.contiguous().view(dtype)
