"""`dsv3 study accumulation`: how much a narrow tensor-core accumulator loses, and what promotion buys.

Two random matrices A [S, K] and B [S, K] (standard normal, quantized to E4M3 with one scale per
tensor) are multiplied through the emulated Hopper adder (the bit-accurate model of MMA-Sim and of
Khattak & Mikaitis: 32 products aligned with the FP22 accumulator to the largest exponent, 13
fraction bits, truncation toward zero) with no promotion and with promotion to FP32 every N_C = 32,
128, 512 products. The error is measured against the exact product, per K, as the maximum over the
trials of a relative error (normwise ||C' - C||_F / ||C||_F by default). The V3 report quotes a
maximum relative error of nearly 2% at K = 4096 without promotion; ``--readings`` lists how other
readings of the hardware and of the claim compare at one K.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress

from dsv3.errors import DSV3Error
from dsv3.io import save_figure
from dsv3.option_lists import parse_list
from dsv3.precision import accumulation as acc_lib
from dsv3.precision.accumulation import Accumulator

DEFAULT_KS = "256,512,1024,2048,4096,8192,16384"
PROMOTIONS: tuple[int | None, ...] = (None, 32, 128, 512)
V3_CLAIM = {"k": 4096, "max_relative_error": 0.02, "source": "V3 report §3.3.2, no promotion"}
MAX_K = 65536
# Input format -> the exponent the adder gives its subnormals (None: e4m3-tile operands carry per-tile
# power-of-two scales, so no single clamp applies; subnormal products never set the window anyway).
MIN_EXPONENTS = {
    "e4m3-tensor": acc_lib.E4M3_MIN_EXPONENT,
    "e4m3-raw": acc_lib.E4M3_MIN_EXPONENT,
    "e4m3-tile": None,
    "bf16": -126,
}


@dataclass(frozen=True)
class Setup:
    """What is multiplied and how the result is judged: inputs, adder model, error measure."""

    dist: str = "normal"
    inputs: str = "e4m3-tensor"
    acc: Accumulator = field(default_factory=Accumulator)
    metric: str = "normwise"
    size: int = 64
    trials: int = 2
    seed: int = 0


def mode_name(promote_every: int | None) -> str:
    return "no promotion" if promote_every is None else f"N_C={promote_every}"


def parse_ks(text: str) -> list[int]:
    ks = sorted(set(parse_list(text, "--k", int, unique=False)))
    group = acc_lib.HOPPER_GROUP
    if not ks or min(ks) < group or max(ks) > MAX_K or any(k % group for k in ks):
        raise DSV3Error(f"--k values must be multiples of {group} in {group}..{MAX_K}, got {text!r}")
    return ks


def measure(setup: Setup, ks: list[int], promotions: tuple[int | None, ...], progress=None) -> dict:
    """errors[mode][k][metric] = one value per trial; a promotion longer than k is skipped (no-op)."""
    errors = {mode_name(p): {} for p in promotions}
    rng = np.random.default_rng(setup.seed)
    for _ in range(setup.trials):
        a, b = acc_lib.random_operands(setup.size, setup.size, max(ks), setup.dist, setup.inputs, rng)
        exact = {k: a[:, :k] @ b[:, :k].T for k in ks}  # exact in float64 for FP8 operands
        for promote_every in promotions:
            valid = [k for k in ks if promote_every is None or promote_every <= k]
            if valid:
                results = acc_lib.limited_matmul(a, b, valid, setup.acc, promote_every, MIN_EXPONENTS[setup.inputs])
                for k in valid:
                    cell = errors[mode_name(promote_every)].setdefault(k, {m: [] for m in acc_lib.ERROR_METRICS})
                    for metric in acc_lib.ERROR_METRICS:
                        cell[metric].append(acc_lib.matrix_error(results[k], exact[k], a[:, :k], b[:, :k], metric))
            if progress is not None:
                progress()
    return errors


def run_study(setup: Setup, ks: list[int]) -> dict:
    """Every (K, promotion) cell: the chosen metric's max and median over trials, and all metrics' max."""
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("accumulating", total=setup.trials * len(PROMOTIONS))
        errors = measure(setup, ks, PROMOTIONS, lambda: progress.advance(task))
    rows = []
    for k in ks:
        row = {"k": k, "max": {}, "median": {}, "metrics": {}}
        for mode, by_k in errors.items():
            if k in by_k:
                row["max"][mode] = max(by_k[k][setup.metric])
                row["median"][mode] = float(np.median(by_k[k][setup.metric]))
                row["metrics"][mode] = {m: max(v) for m, v in by_k[k].items()}
        rows.append(row)
    return {
        "study": "accumulation",
        "config": describe(setup),
        "metric": setup.metric,
        "modes": [mode_name(p) for p in PROMOTIONS],
        "rows": rows,
        "promotion_gain": promotion_gain(rows),
        "v3_claim": V3_CLAIM,
    }


def describe(setup: Setup) -> dict:
    config = asdict(setup)
    config["acc"] = asdict(setup.acc)
    config["reference"] = "exact product of the same quantized operands (float64)"
    return config


def promotion_gain(rows: list[dict]) -> dict | None:
    """What N_C = 128 buys at the claim's K (or the largest K below it)."""
    candidates = [r for r in rows if r["k"] <= V3_CLAIM["k"] and "N_C=128" in r["max"]]
    if not candidates:
        return None
    row = candidates[-1]
    none, promoted = row["max"]["no promotion"], row["max"]["N_C=128"]
    return {"k": row["k"], "no promotion": none, "N_C=128": promoted, "factor": none / promoted if promoted else None}


# --------------------------------------------------------------------------------------------------
# Readings: the same question under other assumptions
# --------------------------------------------------------------------------------------------------


def readings() -> list[tuple[str, str, Setup]]:
    """(description, CLI flags, setup) for each alternative reading, each one change from the default."""
    base = Setup()
    return [
        ("default: bit-accurate Hopper model (MMA-Sim; Khattak & Mikaitis)", "", base),
        (
            "sign-fill shift on two's complement: floor (V3 wording; the previous default)",
            "--product-rounding floor",
            with_acc(base, product_rounding="floor"),
        ),
        ("14 fraction bits (V3: 'around 14 bits')", "--fraction-bits 14", with_acc(base, fraction_bits=14)),
        (
            "only the 32 products aligned, sum added to FP22 (ISCA, literally)",
            "--align products",
            with_acc(base, align_with_accumulator=False),
        ),
        (
            "a product's own leading bit sets the window, not e_a + e_b",
            "--product-exponent product",
            with_acc(base, product_exponent="product"),
        ),
        ("FP22 store rounds to nearest", "--register-rounding nearest", with_acc(base, register_rounding="nearest")),
        ("torch.randn cast to E4M3, no scale", "--inputs e4m3-raw", replace(base, inputs="e4m3-raw")),
        ("E4M3 1x128 / 128x128 tiles, UE8M0 scales", "--inputs e4m3-tile", replace(base, inputs="e4m3-tile")),
        ("BF16 inputs (16-bit products)", "--inputs bf16", replace(base, inputs="bf16")),
        ("U[-1,1) inputs", "--dist uniform-symmetric", replace(base, dist="uniform-symmetric")),
        ("abs N(0,1) inputs", "--dist abs-normal", replace(base, dist="abs-normal")),
        ("U[0,1) inputs", "--dist uniform", replace(base, dist="uniform")),
    ]


def with_acc(setup: Setup, **changes) -> Setup:
    return replace(setup, acc=replace(setup.acc, **changes))


def run_readings(k: int, trials: int, size: int, seed: int) -> dict:
    """Every reading's errors (all metrics, no promotion) and normwise error at N_C = 128, at one K."""
    table = readings()
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("readings", total=len(table) * trials * 2)
        for description, flags, setup in table:
            setup = replace(setup, trials=trials, size=size, seed=seed)
            errors = measure(setup, [k], (None, 128), lambda: progress.advance(task))
            none = {m: max(v) for m, v in errors["no promotion"][k].items()}
            promoted = max(errors["N_C=128"][k]["normwise"]) if k in errors["N_C=128"] else None
            rows.append({"reading": description, "flags": flags, "no promotion": none, "N_C=128 normwise": promoted})
    return {
        "study": "accumulation-readings",
        "k": k,
        "trials": trials,
        "size": size,
        "rows": rows,
        "v3_claim": V3_CLAIM,
    }


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.3g}%"


def study_cells(result: dict) -> list[list[str]]:
    return [[str(row["k"])] + [_pct(row["max"].get(mode)) for mode in result["modes"]] for row in result["rows"]]


def gain_line(result: dict) -> str:
    gain = result["promotion_gain"]
    if gain is None:
        return ""
    factor = "inf" if gain["factor"] is None else f"{gain['factor']:.0f}x"
    return (
        f"K = {gain['k']}: no promotion {_pct(gain['no promotion'])}, N_C = 128 {_pct(gain['N_C=128'])} "
        f"({factor} smaller); V3 report: nearly 2% at K = 4096"
    )


def reading_cells(result: dict) -> list[list[str]]:
    cells = []
    for row in result["rows"]:
        none = row["no promotion"]
        metrics = [_pct(none[m]) for m in acc_lib.ERROR_METRICS]
        cells.append(
            [row["reading"], f"`{row['flags']}`" if row["flags"] else "", *metrics, _pct(row["N_C=128 normwise"])]
        )
    return cells


READING_HEADERS = ["reading", "flags", *acc_lib.ERROR_METRICS, "N_C=128 normwise"]


def markdown_table(headers: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def print_rich(title: str, headers: list[str], cells: list[list[str]], footer: str = "") -> None:
    """The title on its own line (rich wrapped it to the table's width), the table sized to the terminal."""
    from dsv3.termtable import fitted_table, print_table_or_records

    console = Console()
    if headers[0] == "K":
        console.print(title, style="bold", highlight=False)
        console.print(fitted_table(headers, cells, console.width, left=()))
    else:  # the readings: long labels and flags, one block per reading when they cannot fit as a table
        print_table_or_records(console, title, headers, [[c.strip("`") for c in row] for row in cells])
    if footer:
        console.print(footer, highlight=False)


def write_plot(result: dict, path: Path) -> None:
    """Max (solid) and median (dashed) relative error over trials versus K, one colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in result["modes"]:
        rows = [r for r in result["rows"] if mode in r["max"]]
        ks = [r["k"] for r in rows]
        (line,) = ax.plot(ks, [r["max"][mode] for r in rows], "o-", label=mode)
        ax.plot(ks, [r["median"][mode] for r in rows], "--", color=line.get_color())
    ax.plot([V3_CLAIM["k"]], [V3_CLAIM["max_relative_error"]], "k*", markersize=12, label="V3 report: ~2%")
    ax.set(yscale="log", xlabel="K (inner dimension)", ylabel=f"{result['metric']} relative error")
    _k_axis(ax, sorted({r["k"] for r in result["rows"]} | {V3_CLAIM["k"]}))
    cfg = result["config"]
    ax.set_title(f"{cfg['acc']['fraction_bits']}-bit accumulation, {cfg['dist']} {cfg['inputs']} inputs", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _k_axis(ax, ks: list[int]) -> None:
    """A log2 K axis ticked at the K values themselves (256, 512, ..., 16K), skipping any closer than a
    tenth of the axis to the last one kept. Matplotlib's own log ticks labelled minor ticks over a
    short range, and their labels ran into one another."""
    import math

    from matplotlib.ticker import NullLocator

    gap = max(math.log2(max(ks) / min(ks)), 1.0) / 10
    kept = [ks[0]]
    for k in ks[1:]:
        if math.log2(k / kept[-1]) >= gap:
            kept.append(k)
    ax.set_xscale("log", base=2)
    ax.set_xticks(kept, [k_label(k) for k in kept])
    ax.xaxis.set_minor_locator(NullLocator())


def k_label(k: int) -> str:
    return f"{k // 1024}K" if k >= 1024 and k % 1024 == 0 else str(k)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise DSV3Error(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def build_setup(dist, inputs, align, product_rounding, register_rounding, product_exponent, fraction_bits,
                metric, size, trials, seed):
    """Validate the CLI options into a :class:`Setup` (every bad value: one clear message)."""
    _choice("--align", align, ("accumulator", "products"))
    if trials < 1:
        raise DSV3Error("--trials must be at least 1")
    if not 1 <= size <= 512:
        raise DSV3Error(f"--size must lie in 1..512, got {size}")
    acc = Accumulator(
        fraction_bits=fraction_bits,
        align_with_accumulator=align == "accumulator",
        product_rounding=_choice("--product-rounding", product_rounding, acc_lib.PRODUCT_ROUNDINGS),
        register_rounding=_choice("--register-rounding", register_rounding, acc_lib.REGISTER_ROUNDINGS),
        product_exponent=_choice("--product-exponent", product_exponent, acc_lib.PRODUCT_EXPONENTS),
    )
    return Setup(
        dist=_choice("--dist", dist, acc_lib.DISTRIBUTIONS),
        inputs=_choice("--inputs", inputs, acc_lib.INPUT_FORMATS),
        acc=acc,
        metric=_choice("--metric", metric, acc_lib.ERROR_METRICS),
        size=size,
        trials=trials,
        seed=seed,
    )


def main(
    k: str = typer.Option(DEFAULT_KS, "--k", help="Comma-separated inner dimensions (multiples of 32)."),
    trials: int = typer.Option(2, help="Random matrix pairs per cell; cells report the maximum."),
    size: int = typer.Option(64, help="Rows of A and of B (the product is size x size)."),
    dist: str = typer.Option("normal", help="normal, abs-normal, uniform ([0,1)) or uniform-symmetric."),
    inputs: str = typer.Option(
        "e4m3-tensor", help="e4m3-tensor (per-tensor scale), e4m3-raw (no scale), e4m3-tile (V3 tiling) or bf16."
    ),
    align: str = typer.Option("accumulator", help="'accumulator': FP22 sum joins the alignment; 'products'."),
    product_rounding: str = typer.Option("toward_zero", help="toward_zero (measured) or floor (sign-fill shift)."),
    register_rounding: str = typer.Option("truncate", help="FP22 store: truncate or nearest."),
    product_exponent: str = typer.Option("operands", help="Product's alignment exponent: operands (e_a+e_b), product."),
    fraction_bits: int = typer.Option(acc_lib.HOPPER_FRACTION_BITS, help="Fraction bits the adder keeps."),
    metric: str = typer.Option("normwise", help="normwise, max-normalized, elementwise or componentwise."),
    seed: int = typer.Option(0, help="Random seed."),
    compare_readings: bool = typer.Option(False, "--readings", help="Compare readings at the largest --k."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of error versus K."),
) -> None:
    """Relative error of limited-precision FP8 accumulation versus K, with and without promotion."""
    ks = parse_ks(k)
    setup = build_setup(dist, inputs, align, product_rounding, register_rounding, product_exponent,
                        fraction_bits, metric, size, trials, seed)
    if compare_readings:
        if plot is not None:
            raise DSV3Error("--plot draws the K sweep; it cannot be combined with --readings")
        result = run_readings(max(ks), trials, size, seed)
        title, headers, cells, footer = f"readings at K = {result['k']}", READING_HEADERS, reading_cells(result), ""
    else:
        result = run_study(setup, ks)
        if plot is not None:
            write_plot(result, plot)
            result["plot"] = str(plot)
        title = f"{setup.metric} relative error (max over {setup.trials} trials), {setup.dist} {setup.inputs}"
        headers, cells, footer = ["K", *result["modes"]], study_cells(result), gain_line(result)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif markdown:
        sys.stdout.write(markdown_table(headers, cells) + ("\n\n" + footer if footer else "") + "\n")
    else:
        print_rich(title, headers, cells, footer)
