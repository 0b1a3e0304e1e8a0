"""`dsv3 study accumulation`: how much a narrow tensor-core accumulator loses, and what promotion buys.

Random FP8 (E4M3, per-tensor scaled) dot products of length K are summed by the emulated Hopper
accumulator (32 products aligned to the largest exponent, 13 fraction bits kept, truncation) with no
promotion and with promotion to FP32 every N_C = 32, 128, 512 products; the relative error against the
exact sum is reported per K (maximum and median over the trials). The V3 report quotes a maximum
relative error of nearly 2% at K = 4096 without promotion.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dsv3.errors import DSV3Error
from dsv3.precision import accumulation

DEFAULT_KS = "256,512,1024,2048,4096,8192,16384"
PROMOTIONS: tuple[int | None, ...] = (None, 32, 128, 512)
V3_CLAIM = {"k": 4096, "max_relative_error": 0.02, "source": "V3 report §3.3.2, no promotion"}


def mode_name(promote_every: int | None) -> str:
    return "no promotion" if promote_every is None else f"N_C={promote_every}"


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise DSV3Error(f"--k must be comma-separated integers, got {text!r}") from exc
    if not ks or min(ks) < 1 or max(ks) > 65536:
        raise DSV3Error(f"--k values must lie in 1..65536, got {text!r}")
    return ks


def run_study(ks: list[int], trials: int, dist: str, align: str, fraction_bits: int, seed: int) -> dict:
    """Every (K, promotion) cell: max and median relative error over ``trials`` dot products."""
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("accumulating", total=len(ks) * len(PROMOTIONS))
        for k in ks:
            row = {"k": k, "max": {}, "median": {}}
            for promote_every in PROMOTIONS:
                if promote_every is not None and promote_every > k:
                    progress.advance(task)
                    continue  # promotion never triggers: same as no promotion
                errors = accumulation.relative_errors(
                    k,
                    trials,
                    dist,
                    promote_every,
                    seed=seed,
                    fraction_bits=fraction_bits,
                    align_with_accumulator=align == "accumulator",
                )
                row["max"][mode_name(promote_every)] = float(errors.max())
                row["median"][mode_name(promote_every)] = float(np.median(errors))
                progress.advance(task)
            rows.append(row)
    return {
        "study": "accumulation",
        "config": {
            "trials": trials,
            "dist": dist,
            "align": align,
            "fraction_bits": fraction_bits,
            "group": accumulation.HOPPER_GROUP,
            "seed": seed,
            "inputs": "E4M3, one scale per tensor; exact reference in float64",
        },
        "modes": [mode_name(p) for p in PROMOTIONS],
        "rows": rows,
        "v3_claim": V3_CLAIM,
    }


def markdown_table(result: dict) -> str:
    modes = result["modes"]
    lines = [
        "| K | " + " | ".join(f"{m} max (median)" for m in modes) + " |",
        "|---:|" + "---:|" * len(modes),
    ]
    for row in result["rows"]:
        cells = [_cell(row, m) for m in modes]
        lines.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict, mode: str) -> str:
    if mode not in row["max"]:
        return "-"
    return f"{row['max'][mode]:.2e} ({row['median'][mode]:.2e})"


def print_rich(result: dict) -> None:
    cfg = result["config"]
    table = Table(title=f"relative error of FP8 dot products, {cfg['dist']} inputs, {cfg['trials']} trials")
    table.add_column("K", justify="right")
    for mode in result["modes"]:
        table.add_column(f"{mode}\nmax (median)", justify="right")
    for row in result["rows"]:
        table.add_row(str(row["k"]), *[_cell(row, m) for m in result["modes"]])
    Console().print(table)


def write_plot(result: dict, path: Path) -> None:
    """Max (solid) and median (dashed) relative error versus K, one colour per promotion mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in result["modes"]:
        ks = [r["k"] for r in result["rows"] if mode in r["max"]]
        (line,) = ax.plot(ks, [r["max"][mode] for r in result["rows"] if mode in r["max"]], "o-", label=mode)
        ax.plot(ks, [r["median"][mode] for r in result["rows"] if mode in r["max"]], "--", color=line.get_color())
    ax.plot([V3_CLAIM["k"]], [V3_CLAIM["max_relative_error"]], "k*", markersize=12, label="V3 report: ~2%")
    ax.set(xscale="log", yscale="log", xlabel="K (dot-product length)", ylabel="relative error")
    cfg = result["config"]
    ax.set_title(f"{cfg['fraction_bits']}-bit accumulation, {cfg['dist']} FP8 inputs (solid max, dashed median)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def atomic_savefig(fig, path: Path) -> None:
    """Save to a temp file beside ``path`` and rename, so a crash never leaves half an image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a figure is meant to be read
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(
    k: str = typer.Option(DEFAULT_KS, "--k", help="Comma-separated dot-product lengths."),
    trials: int = typer.Option(256, help="Random dot products per (K, mode) cell."),
    dist: str = typer.Option("uniform", help="Input values before FP8: 'uniform' [0,1) or 'normal'."),
    align: str = typer.Option(
        "accumulator", help="'accumulator': the running sum joins the alignment; 'products': only the 32 products."
    ),
    fraction_bits: int = typer.Option(accumulation.HOPPER_FRACTION_BITS, help="Fraction bits the adder keeps."),
    seed: int = typer.Option(0, help="Random seed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of error versus K."),
) -> None:
    """Relative error of limited-precision FP8 accumulation versus K, with and without promotion."""
    if trials < 1:
        raise DSV3Error("--trials must be at least 1")
    if align not in ("accumulator", "products"):
        raise DSV3Error(f"--align must be 'accumulator' or 'products', got {align!r}")
    if not 1 <= fraction_bits <= 40:
        raise DSV3Error(f"--fraction-bits must lie in 1..40, got {fraction_bits}")
    if dist not in ("uniform", "normal"):
        raise DSV3Error(f"--dist must be 'uniform' or 'normal', got {dist!r}")
    result = run_study(parse_ks(k), trials, dist, align, fraction_bits, seed)
    if plot is not None:
        write_plot(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif markdown:
        sys.stdout.write(markdown_table(result) + "\n")
    else:
        print_rich(result)
