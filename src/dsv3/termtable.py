"""Text output for the terminal: numbers in units that scale, and rich tables that fit the terminal
without splitting a number or a name.

Rich narrows a too-wide table by shrinking its widest columns first, whatever they hold, and then folds
their cells mid-word: ``1021134.7`` became ``1021134.`` over ``7``. Here every column is at least as
wide as its longest word (so cells wrap only at spaces) and the space left is shared out by need.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.table import Table

MAX_WORD = 24  # a longer space-free run (a path, a long name) may fold rather than widen its column


def _scaled(n: float, units: tuple[tuple[float, str], ...], base: str, digits: int = 4) -> str:
    """``n`` in the largest unit it reaches, ``digits`` significant digits: a 3M-parameter model's 7.9
    MFLOP and V3's 250.4 GFLOP both read as numbers, never as 0.0 of a unit too large for them."""
    for scale, suffix in units:
        if abs(n) >= scale:
            return f"{n / scale:#.{digits}g} {suffix}"
    return f"{n:.{digits}g} {base}"


def fmt_flops(n: float) -> str:
    """FLOPs in the unit that fits: 7.864 MFLOP, 250.4 GFLOP, 2.473 TFLOP."""
    units = ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP"))
    return _scaled(n, units, "FLOP")


def fmt_seconds(t: float) -> str:
    """A duration in s, ms or µs: 15.11 ms, 10.1 µs."""
    if t >= 1.0:
        return f"{t:#.4g} s"
    if t >= 1e-3:
        return f"{t * 1e3:#.4g} ms"
    return f"{t * 1e6:#.4g} µs"


def fmt_rate(x: float) -> str:
    """A rate without a unit: 180.1, 101.7k, 1.021M (short enough for a narrow column)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.4g}"


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units: 512 B, 70.27 KB, 28.19 GB."""
    return _scaled(n, ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")), "B")


def longest_word(texts: Sequence[str]) -> int:
    """The widest space-free run in ``texts``: the narrowest a column can be without splitting one."""
    return max((len(word) for text in texts for word in str(text).split()), default=1)


def minimum_widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    """Each column's longest word (at most MAX_WORD): the narrowest it can be without splitting one."""
    columns = [[h, *(row[i] for row in rows)] for i, h in enumerate(headers)]
    return [min(longest_word(col), MAX_WORD, max(len(str(c)) for c in col)) for col in columns]


def fits(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> bool:
    """Whether a table of these cells can be ``width`` columns wide without splitting a word."""
    return sum(minimum_widths(headers, rows)) + 3 * len(headers) + 1 <= width


def print_table_or_records(console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A fitted table when its words fit the console; otherwise one block per row ("header: value" lines
    under the row's first cell), which stays readable however many columns the table has."""
    console.print(title, style="bold", highlight=False)
    if fits(headers, rows, console.width):
        console.print(fitted_table(headers, rows, console.width))
        return
    for row in rows:
        console.print(row[0], style="bold", highlight=False)
        for name, cell in zip(headers[1:], row[1:], strict=True):
            if cell:
                console.print(f"  {name}: {cell}", highlight=False)


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[int] | None:
    """Explicit widths when the table's natural width exceeds ``width`` terminal columns, else None
    (rich's own layout). Each column first gets its longest word; the space left then goes to keeping
    cells on one line (the smallest needs first, so that most columns fit whole), then headers."""
    columns = [[h, *(row[i] for row in rows)] for i, h in enumerate(headers)]
    natural = [max(len(str(c)) for c in col) for col in columns]
    room = width - (3 * len(headers) + 1)  # borders and one space of padding on each side
    if sum(natural) <= room:
        return None
    widths = minimum_widths(headers, rows)
    cells = [max([len(str(c)) for c in col[1:]] + [w]) for col, w in zip(columns, widths, strict=True)]
    spare = room - sum(widths)
    for target in (cells, natural):
        for i in sorted(range(len(widths)), key=lambda j: target[j] - widths[j]):
            grant = max(0, min(target[i] - widths[i], spare))
            widths[i] += grant
            spare -= grant
    return widths


def fitted_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    left: Sequence[int] = (0,),
    section_ends: Collection[int] = (),
    **table_kw,
) -> Table:
    """A rich Table of ``rows`` (strings) sized for ``width`` columns; columns in ``left`` are labels
    (left-aligned), the others numbers (right-aligned); a rule follows each row index in
    ``section_ends``."""
    widths = column_widths(headers, rows, width)
    table = Table(**table_kw)
    for i, name in enumerate(headers):
        table.add_column(name, justify="left" if i in left else "right", overflow="fold",
                         width=None if widths is None else widths[i])
    for i, row in enumerate(rows):
        table.add_row(*row, end_section=i in section_ends)
    return table
