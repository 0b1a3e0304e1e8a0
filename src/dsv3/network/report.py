"""Text and Markdown tables, byte-size parsing, and PNG plots (matplotlib, Agg), written atomically."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import numpy as np

from dsv3.errors import DSV3Error
from dsv3.io import save_figure

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'4096', '256MiB', '1.5GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise DSV3Error(f"cannot read {text!r} as a byte count (examples: 4096, 256MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise DSV3Error(f"byte count must be positive, got {text!r}")
    return value


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}B"


def format_table(headers: list[str], rows: list[list], markdown: bool = False, width: int | None = None) -> str:
    """A plain aligned text table, or a GitHub Markdown table. When one-line headers would make the
    table wider than ``width`` (default: the terminal's), headers wrap at spaces onto more lines;
    cells never wrap, so no number is ever split."""
    cells = [[_fmt(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    width = width or shutil.get_terminal_size().columns
    head = [[h] for h in headers]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if sum(widths) + 2 * (len(widths) - 1) > width:
        widths = [max([len(w) for w in h.split()] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
        head = [textwrap.wrap(h, w) or [""] for h, w in zip(headers, widths, strict=True)]
    depth = max(len(h) for h in head)
    head = [[""] * (depth - len(h)) + h for h in head]  # headers sit on the rule, as rich's do
    out = ["  ".join(h[line].ljust(w) for h, w in zip(head, widths, strict=True)).rstrip() for line in range(depth)]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in cells]
    return "\n".join(out)


def format_notes(notes: list[str], width: int | None = None) -> str:
    """``note: ...`` lines wrapped at spaces to the terminal's width, continuation lines indented."""
    width = width or shutil.get_terminal_size().columns
    return "\n".join(textwrap.fill(f"note: {n}", width, subsequent_indent="  ") for n in notes)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_utilization(util_by_kind: dict[str, np.ndarray], title: str, path: Path) -> Path:
    """Histogram of time-averaged link utilization, one panel per link class that carried traffic."""
    plt = _pyplot()
    kinds = [k for k, u in util_by_kind.items() if len(u)]
    # constrained layout: the figure title above the panels' titles, each y label clear of its neighbour's ticks
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(4 * max(1, len(kinds)), 3.4), squeeze=False,
                             layout="constrained")
    for ax, kind in zip(axes[0], kinds, strict=False):
        ax.hist(np.clip(util_by_kind[kind], 0, 1), bins=20, range=(0, 1), color="#4477aa")
        ax.set_title(f"{kind} ({len(util_by_kind[kind])} links)")
        ax.set_xlabel("utilization")
        ax.set_ylabel("links")
    fig.suptitle(title)
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    return path


def plot_sweep(rows: list[dict], traffic: str, plot_dir: Path) -> list[Path]:
    """Bandwidth vs message size (at the largest GPU count) and vs GPU count (at the largest size)."""
    plt = _pyplot()
    out = []
    series = sorted({(r["topology"], r["routing"]) for r in rows})
    big_n = max(r["gpus"] for r in rows)
    big_s = max(r["message_bytes"] for r in rows)
    for axis, fixed_key, fixed, name in (("message_bytes", "gpus", big_n, "bw_vs_size"),
                                         ("gpus", "message_bytes", big_s, "bw_vs_gpus")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (topo, routing) in enumerate(series):
            pts = sorted((r[axis], r["algbw_GBps"]) for r in rows
                         if r["topology"] == topo and r["routing"] == routing and r[fixed_key] == fixed)
            if pts:
                xs, ys = zip(*pts, strict=True)
                # topologies often reach the same bandwidth: later series are drawn thinner on top of earlier
                # ones, so a series equal to another stays visible instead of vanishing under it
                width = 1.0 + 2.5 * (len(series) - 1 - i) / max(1, len(series) - 1)
                ax.plot(xs, ys, marker="o", lw=width, ms=3 + 1.5 * width, label=f"{topo.upper()} {routing}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)" if axis == "message_bytes" else "GPUs")
        ax.set_ylabel("algorithm bandwidth per GPU (GB/s)")
        top = max((line.get_ydata().max() for line in ax.lines), default=1.0)
        ax.set_ylim(0, 1.15 * top)  # from zero: a difference of a few tenths of a percent must not look like a cliff
        where = f"{fixed} GPUs" if fixed_key == "gpus" else human_bytes(fixed)
        ax.set_title(f"{traffic}, {where}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = plot_dir / f"{traffic}_{name}.png"
        save_figure(fig, path, dpi=120, bbox_inches="tight")
        out.append(path)
    return out
