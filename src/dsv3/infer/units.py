"""Numbers for people: durations, byte counts and counts in units that scale (µs/ms/s, KB/MB/GB, K/M/B),
three significant digits, so that a line of the report fits 80 columns and reads at a glance."""

from __future__ import annotations

from dsv3.errors import DSV3Error


def fmt_duration(seconds: float) -> str:
    """0.00042 -> '420 µs', 0.0123 -> '12.3 ms', 1.5 -> '1.50 s'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            return f"{_sig3(seconds / scale)} {unit}"
    raise AssertionError("unreachable")


def fmt_bytes(n: float) -> str:
    """Decimal units, as the paper's tables count them: 70272 -> '70.3 KB'."""
    return _scaled(n, (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)), "B")


def fmt_count(n: float) -> str:
    """3_250_000 -> '3.25M'."""
    return _scaled(n, (("B", 1e9), ("M", 1e6), ("K", 1e3)), "").replace(" ", "")


def _scaled(n: float, units: tuple[tuple[str, float], ...], base: str) -> str:
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} {base}" if float(n).is_integer() else f"{_sig3(n)} {base}"


def _sig3(x: float) -> str:
    """Three significant digits without exponent notation: 1.23, 12.3, 123, 1234."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def parse_size(text: str, flag: str) -> int:
    """Bytes from '0', '512M', '1.5G' (powers of 1000, as the reports print them) or '64Ki', '2GiB'
    (powers of 1024): one clear error otherwise."""
    s = text.strip().upper().removesuffix("B")
    binary = s.endswith("I")
    s = s.removesuffix("I")
    unit = s[-1:] if s[-1:] in ("K", "M", "G", "T") else ""
    scale = (1024 if binary else 1000) ** ("KMGT".index(unit) + 1) if unit else 1
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise DSV3Error(f"{flag} must be a size such as 0, 512M or 2G, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise DSV3Error(f"{flag} must be >= 0, got {text!r}")
    return int(value * scale)
