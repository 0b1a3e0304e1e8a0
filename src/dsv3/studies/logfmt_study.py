"""`dsv3 study logfmt`: how much each candidate MoE-combine format loses (PAPER.md §7).

Every format rounds the same float32 data: BF16, E4M3 and E5M2 with one amax scale per 1x128 tile, and
LogFMT-8/10 (plus LogFMT-8 rounded in log space, the variant the paper rejects for its bias). Data: Gaussian,
Student-t (heavy tails), uniform, and any tensors saved with torch.save and passed with --activations, e.g. MoE
outputs captured from a trained model. Torch is imported only when the study runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from dsv3.errors import DSV3Error
from dsv3.io import save_figure

FORMATS = ("bf16", "e4m3", "e5m2", "logfmt8", "logfmt10", "logfmt8-logspace")
FP8_SCALE_BITS = 32  # one float32 scale per 1x128 tile


def quantize_as(x, fmt: str):
    """x rounded through `fmt` (one of FORMATS), back in x.dtype."""
    from dsv3.precision import logfmt

    if fmt == "logfmt8-logspace":
        return logfmt.quantize(x, 8, rounding="log")
    return logfmt.round_trip(x, fmt)


def wire_bits_per_element(x, fmt: str) -> float:
    """Bits on the wire per element, metadata included (LogFMT metadata is the input dtype's amax/amin)."""
    from dsv3.precision import logfmt

    if fmt == "bf16":
        return 16.0
    if fmt in ("e4m3", "e5m2"):
        return 8 + FP8_SCALE_BITS / logfmt.TILE
    bits = 8 if fmt.startswith("logfmt8") else 10
    return logfmt.encode(x, bits).bits_per_element


def error_metrics(x, q) -> dict[str, float]:
    """Relative RMSE, signed mean error and magnitude bias, the last two relative to mean |x|."""
    x, q = x.double(), q.double()
    scale = x.abs().mean().item()
    return {
        "rel_rmse": ((q - x).norm() / x.norm()).item(),
        "mean_bias": (q - x).mean().item() / scale,
        "magnitude_bias": (q.abs() - x.abs()).mean().item() / scale,
    }


def synthetic_data(numel: int, df: int, seed: int) -> dict:
    """Gaussian, Student-t and uniform data, float32 [numel / 4096, 4096], from one seeded generator.

    Uniform data has a flat density between any two adjacent levels: where linear-space rounding is exactly
    unbiased and log-space rounding is not, the paper's argument in its cleanest form.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (numel // 4096, 4096)
    gaussian = torch.randn(shape, generator=generator)
    chi2 = torch.randn((df, *shape), generator=generator).square_().sum(0)  # sum of df squared normals
    student = torch.randn(shape, generator=generator) / (chi2 / df).sqrt_()
    uniform = torch.rand(shape, generator=generator).mul_(2).sub_(1)
    return {"gaussian": gaussian, f"student-t(df={df})": student, "uniform(-1,1)": uniform}


def load_activations(path: Path) -> dict:
    """Tensors saved with torch.save: one tensor, or a dict of named tensors. Float32, checked."""
    import torch

    if not path.is_file():
        raise DSV3Error(f"activations file not found: {path}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or foreign file: say so in one line
        raise DSV3Error(f"cannot read activations from {path}: {exc.__class__.__name__}") from exc
    items = loaded.items() if isinstance(loaded, dict) else [("", loaded)]
    data = {}
    for key, tensor in items:
        name = f"{path.stem}:{key}" if key else path.stem
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            raise DSV3Error(f"activations {name!r} must be a non-empty floating-point tensor")
        if not bool(torch.isfinite(tensor).all()):
            raise DSV3Error(f"activations {name!r} contain inf or nan")
        data[name] = tensor.detach().to(torch.float32)
    return data


def run_study(data: dict, config: dict) -> dict:
    """Every (data, format) cell: wire bits per element and the error metrics."""
    from rich.console import Console
    from rich.progress import Progress

    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("quantizing", total=len(data) * len(FORMATS))
        for name, x in data.items():
            for fmt in FORMATS:
                row = {"data": name, "format": fmt, "bits_per_element": wire_bits_per_element(x, fmt)}
                row.update(error_metrics(x, quantize_as(x, fmt)))
                rows.append(row)
                progress.advance(task)
    datasets = {name: {"shape": list(x.shape), "numel": x.numel()} for name, x in data.items()}
    return {"study": "logfmt", "config": config, "formats": list(FORMATS), "datasets": datasets, "rows": rows}


def markdown_table(result: dict) -> str:
    lines = [
        "| data | format | bits/element | rel. RMSE | mean bias | magnitude bias |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['data']} | {row['format']} | {row['bits_per_element']:.2f} | {row['rel_rmse']:.2e} "
            f"| {row['mean_bias']:+.1e} | {row['magnitude_bias']:+.1e} |"
        )
    return "\n".join(lines)


def print_rich(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rounding error of MoE-combine formats (biases relative to mean |x|)")
    for column in ("data", "format", "bits/element", "rel. RMSE", "mean bias", "magnitude bias"):
        table.add_column(column, justify="left" if column in ("data", "format") else "right")
    for row in result["rows"]:
        table.add_row(
            row["data"],
            row["format"],
            f"{row['bits_per_element']:.2f}",
            f"{row['rel_rmse']:.2e}",
            f"{row['mean_bias']:+.1e}",
            f"{row['magnitude_bias']:+.1e}",
        )
    Console().print(table)


def write_plot(result: dict, path: Path) -> None:
    """Grouped bars per data set: relative RMSE (log scale) and magnitude bias for each format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, formats = list(result["datasets"]), result["formats"]
    cell = {(r["data"], r["format"]): r for r in result["rows"]}
    width = 0.8 / len(formats)
    fig, (ax_rmse, ax_bias) = plt.subplots(1, 2, figsize=(11, 4.6))
    for i, fmt in enumerate(formats):
        xs = [j + (i - (len(formats) - 1) / 2) * width for j in range(len(names))]
        ax_rmse.bar(xs, [cell[n, fmt]["rel_rmse"] for n in names], width, label=fmt)
        ax_bias.bar(xs, [cell[n, fmt]["magnitude_bias"] for n in names], width, label=fmt)
    ax_rmse.set(yscale="log", ylabel="relative RMSE", title="rounding error")
    ax_bias.set(ylabel="mean(|q| - |x|) / mean |x|", title="magnitude bias")
    ax_bias.axhline(0, color="black", linewidth=0.8)
    for ax in (ax_rmse, ax_bias):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = ax_rmse.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(formats), fontsize=8)
    fig.suptitle("MoE-combine formats, 1x128 tiles (LogFMT: PAPER.md §7)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    if not path.parent.is_dir():
        raise DSV3Error(f"--plot: directory does not exist: {path.parent}")
    save_figure(fig, path, dpi=120)


def main(
    numel: int = typer.Option(1 << 20, help="Elements per synthetic data set (rows of 4096)."),
    df: int = typer.Option(3, help="Degrees of freedom of the Student-t data (1..30)."),
    activations: Path | None = typer.Option(
        None, "--activations", help="A torch.save'd tensor (or dict of tensors), e.g. captured MoE outputs."
    ),
    seed: int = typer.Option(0, help="Random seed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of the error table."),
) -> None:
    """Relative RMSE and bias of LogFMT-8/10, E4M3, E5M2 (1x128 scaling) and BF16 on the same data."""
    if not 4096 <= numel <= 1 << 26:
        raise DSV3Error(f"--numel must lie in 4096..{1 << 26}, got {numel}")
    if not 1 <= df <= 30:
        raise DSV3Error(f"--df must lie in 1..30, got {df}")
    if as_json and markdown:
        raise DSV3Error("choose one of --json and --markdown")
    if plot is not None and not plot.parent.is_dir():
        raise DSV3Error(f"--plot: directory does not exist: {plot.parent}")
    data = synthetic_data(numel, df, seed)
    if activations is not None:
        data.update(load_activations(activations))
    config = {"numel": numel, "df": df, "seed": seed, "activations": str(activations) if activations else None}
    result = run_study(data, config)
    if plot is not None:
        write_plot(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif markdown:
        sys.stdout.write(markdown_table(result) + "\n")
    else:
        print_rich(result)
