"""`dsv3 study fp8`: why fine-grained FP8 scaling matters, and what caching activations in FP8 saves.

Three measurements:

1. Quantization error of activations under per-tensor, per-row (per-token) and 1x128-tile scaling,
   on synthetic activations with outlier channels of growing size, or on real ones (``--activations``).
   An outlier sets the scale of everything that shares it; ordinary values then sink to FP8
   subnormals or zero. We report the overall relative RMSE, the median over channels of each
   channel's relative RMSE (what ordinary channels suffer), and the share of non-zero values lost.
2. Activation memory held for backward by a stack of linears, BF16 ``nn.Linear`` against
   ``FP8Linear``, counted from the tensors autograd actually saves.
3. ``--train``: the same training run (seed, data, steps) in BF16 autocast, fine-grained FP8 and
   per-tensor FP8 (every linear and the routed experts), through the trainer's Python API;
   final held-out loss of each and the relative gap to BF16 (V3 claims < 0.25% for fine-grained).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import typer
from rich.console import Console
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.io import save_figure
from dsv3.option_lists import parse_list
from dsv3.precision import fp8
from dsv3.precision.fp8_linear import convert_to_fp8
from dsv3.termtable import fitted_table

SCHEMES = ("per-tensor", "per-row", "1x128")
# Training variants: (trainer precision, FP8 scaling or None).
VARIANTS = {"bf16": ("bf16", None), "fp8-fine": ("fp8", "fine"), "fp8-tensor": ("fp8", "tensor")}
OUTLIER_FACTOR = 20.0  # a channel whose amax exceeds 20x the median channel amax counts as an outlier


def quantize_dequantize(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """Round trip of ``x: [T, D]`` through FP8 E4M3 under one scaling scheme."""
    if scheme == "per-tensor":
        q, scale = fp8.quantize_per_tensor(x)
        return q.float() * scale
    block = (1, x.shape[1]) if scheme == "per-row" else (1, fp8.TILE)
    return fp8.dequantize(*fp8.quantize(x, block=block), block)


def error_metrics(x: torch.Tensor, scheme: str) -> dict[str, float]:
    """Relative RMSE overall, median per-channel relative RMSE, and the share of non-zeros flushed to 0."""
    x = x.float()
    back = quantize_dequantize(x, scheme)
    err = x - back
    channel_norm = x.norm(dim=0)
    live = channel_norm > 0
    per_channel = err.norm(dim=0)[live] / channel_norm[live]
    nonzero = x != 0
    return {
        "rel_rmse": float(err.norm() / x.norm()),
        "median_channel_rel_rmse": float(per_channel.median()),
        "flushed_to_zero": float(((back == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)),
    }


def outlier_channels(x: torch.Tensor) -> int:
    amax = x.abs().amax(dim=0)
    return int((amax > OUTLIER_FACTOR * amax.median()).sum())


def channel_amax_ratio(x: torch.Tensor) -> float:
    """How far the largest channel stands out: max over median of the per-channel amax."""
    amax = x.abs().amax(dim=0)
    return float(amax.max() / amax.median().clamp(min=1e-30))


def synthetic_activations(tokens: int, dim: int, outlier_scale: float, n_outliers: int, seed: int) -> torch.Tensor:
    """Gaussian activations [tokens, dim]; ``n_outliers`` spread channels scaled by ``outlier_scale``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen)
    if outlier_scale > 0 and n_outliers > 0:
        channels = torch.randperm(dim, generator=gen)[:n_outliers]
        x[:, channels] *= outlier_scale
    return x.bfloat16()


def load_activations(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pt`` file holding one tensor or a dict of tensors [..., D]; each flattened to [tokens, D]."""
    if not path.is_file():
        raise DSV3Error(f"activations file {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DSV3Error(f"cannot read activations from {path}: {exc}") from exc
    tensors = {"activations": obj} if isinstance(obj, torch.Tensor) else obj
    if not isinstance(tensors, dict) or not tensors:
        raise DSV3Error(f"{path} must hold a tensor or a non-empty dict of tensors")
    out = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2 or t.numel() == 0:
            raise DSV3Error(f"{path}: entry {name!r} is not a floating-point tensor with at least 2 dims")
        out[str(name)] = t.reshape(-1, t.shape[-1])
    return out


def quantization_rows(named: dict[str, torch.Tensor], outlier_scale: float | None) -> list[dict]:
    return [
        {
            "tensor": name,
            "shape": list(x.shape),
            "outlier_scale": outlier_scale,
            "outlier_channels": outlier_channels(x.float()),
            "max_over_median_channel_amax": channel_amax_ratio(x.float()),
            "schemes": {scheme: error_metrics(x, scheme) for scheme in SCHEMES},
        }
        for name, x in named.items()
    ]


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during ``model(x)``, parameters excluded."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.requires_grad_(True))
    return sum(seen.values())


def activation_memory(tokens: int, dim: int, layers: int, seed: int) -> dict:
    """A stack of ``layers`` linears (no nonlinearity, so only the linears save anything): BF16 vs FP8."""
    torch.manual_seed(seed)
    bf16 = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).bfloat16()
    x = torch.randn(tokens, dim).bfloat16()
    bf16_bytes = saved_activation_bytes(bf16, x)
    fp8_model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    convert_to_fp8(fp8_model)
    fp8_bytes = saved_activation_bytes(fp8_model, x.detach())
    return {
        "tokens": tokens,
        "dim": dim,
        "layers": layers,
        "bf16_bytes": bf16_bytes,
        "fp8_bytes": fp8_bytes,
        "saved_fraction": 1 - fp8_bytes / bf16_bytes,
        "expected_fp8_fraction": (1 + 4 / fp8.TILE) / 2,  # 1 byte + one FP32 scale per 128, vs 2 bytes
    }


def train_variant(variant: str, seed: int, run_dir: Path, on_step=None, **options) -> dict:
    """One training run of ``variant`` through ``dsv3.train.run.run_training``; returns its curves.
    ``on_step(row)`` sees every step (the study's progress bar)."""
    from dsv3.precision.fp8_linear import default_scaling
    from dsv3.studies.progress import finished
    from dsv3.train.metrics import read_rows
    from dsv3.train.options import TrainOptions
    from dsv3.train.run import run_training

    precision, scaling = VARIANTS[variant]
    opts = TrainOptions(out=str(run_dir), precision=precision, seed=seed, keep_last=1, **options)
    opts.save_every = opts.steps  # only the final checkpoint
    with default_scaling(scaling or "fine"):
        summary = finished(run_training(opts, on_step=on_step, show_progress=False, plots=False),
                           f"{variant}, seed {seed}")
    rows = read_rows(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval"]
    return {
        "variant": variant,
        "seed": seed,
        "val_loss": summary["val_loss"],
        "skipped_steps": summary["skipped_steps"],
        "train_seconds": summary["train_seconds"],
        "train_curve": [[r["step"], r["loss"]] for r in rows if r.get("kind") == "train" and r.get("loss")],
        "val_curve": [[r["step"], r["val_loss"]] for r in evals],
    }


def compare_training(
    seeds: list[int], runs_dir: Path, variants: tuple[str, ...] = tuple(VARIANTS), **options
) -> dict:
    """Every variant for every seed (same seed: same initial weights and batch order), and per seed
    the relative gap of each variant's final held-out loss to BF16's."""
    from dsv3.studies.progress import RunsProgress

    runs = []
    with RunsProgress("fp8 study", len(seeds) * len(variants), options.get("steps", 100)) as progress:
        for seed in seeds:
            for v in variants:
                on_step = progress.start_run(f"{v}, seed {seed}")
                runs.append(train_variant(v, seed, runs_dir / f"seed{seed}-{v}", on_step=on_step, **options))
                progress.note(f"seed {seed} {v}: val loss {runs[-1]['val_loss']:.4f} "
                              f"({runs[-1]['train_seconds']:.0f}s)")
    summary = {}
    for v in variants:
        losses = [r["val_loss"] for r in runs if r["variant"] == v]
        gaps = [
            (r["val_loss"] - b["val_loss"]) / b["val_loss"]
            for r in runs
            if r["variant"] == v
            for b in runs
            if b["variant"] == "bf16" and b["seed"] == r["seed"]
        ]
        summary[v] = {
            "val_loss": losses,
            "mean_val_loss": sum(losses) / len(losses),
            "rel_gap_to_bf16": gaps,
            "mean_rel_gap_to_bf16": sum(gaps) / len(gaps) if gaps else None,
        }
    bf16 = summary.get("bf16", {}).get("val_loss", [])
    spread = (max(bf16) - min(bf16)) / min(bf16) if len(bf16) > 1 else None
    return {"options": options, "seeds": seeds, "runs": runs, "summary": summary, "bf16_seed_spread": spread}


def training_markdown(training: dict) -> str:
    o = training["options"]
    lines = [
        f"Preset `{o.get('preset', 'nano')}`, {o.get('steps')} steps of {o.get('batch_size')} x {o.get('seq_len')}"
        f" tokens, seeds {training['seeds']}, held-out loss on {o.get('eval_tokens')} tokens.",
        "",
        "| variant | final val loss per seed | mean | relative gap to BF16 per seed | mean gap |",
        "|---|---|---:|---|---:|",
    ]
    for v, s in training["summary"].items():
        losses = ", ".join(f"{x:.4f}" for x in s["val_loss"])
        gaps = ", ".join(f"{100 * g:+.2f}%" for g in s["rel_gap_to_bf16"])
        mean_gap = s["mean_rel_gap_to_bf16"]
        lines.append(
            f"| {v} | {losses} | {s['mean_val_loss']:.4f} | {gaps} | "
            + (f"{100 * mean_gap:+.2f}% |" if mean_gap is not None else "- |")
        )
    if training["bf16_seed_spread"] is not None:
        lines += ["", f"Run-to-run spread of BF16 over seeds: {100 * training['bf16_seed_spread']:.2f}%."]
    return "\n".join(lines)


def write_training_plot(training: dict, path: Path) -> None:
    """Train loss (smoothed) and held-out loss per variant, one line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(VARIANTS, ("C0", "C1", "C3"), strict=True))
    # FP8 and BF16 curves nearly coincide: each later variant is drawn thinner on top of the earlier ones,
    # so all stay visible where they overlap (before, the last one drawn hid the others)
    widths = dict(zip(VARIANTS, (4.0, 2.4, 1.0), strict=True))
    styles = ("-", "--", ":", "-.")
    for i, seed in enumerate(training["seeds"]):
        for run in (r for r in training["runs"] if r["seed"] == seed):
            style, color = styles[i % len(styles)], colors[run["variant"]]
            steps, losses = zip(*run["train_curve"], strict=True)
            ax_train.plot(steps, _smooth(list(losses)), style, color=color, lw=widths[run["variant"]],
                          label=f"{run['variant']} seed {seed}")
            if run["val_curve"]:
                vsteps, vloss = zip(*run["val_curve"], strict=True)
                ax_val.plot(vsteps, vloss, style + "o", color=color, lw=widths[run["variant"]],
                            ms=2 + widths[run["variant"]], label=f"{run['variant']} seed {seed}")
    ax_train.set(xlabel="step", ylabel="train loss (EMA 0.9)", title="Training loss")
    ax_val.set(xlabel="step", ylabel="held-out loss", title="Held-out loss")
    for ax in (ax_train, ax_val):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    out, avg = [], values[0]
    for v in values:
        avg = beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def markdown(result: dict) -> str:
    lines = [
        "| tensor | outlier scale | outlier channels (max/median channel amax) | "
        + " | ".join(f"{s} rel RMSE / median channel / flushed" for s in SCHEMES)
        + " |",
        "|---|---:|---:|" + "---:|" * len(SCHEMES),
    ]
    for row in result["quantization_error"]:
        cells = [_cell(row["schemes"][s]) for s in SCHEMES]
        scale = "-" if row["outlier_scale"] is None else f"{row['outlier_scale']:g}"
        outliers = f"{row['outlier_channels']} ({row['max_over_median_channel_amax']:.1f})"
        lines.append(f"| {row['tensor']} | {scale} | {outliers} | " + " | ".join(cells) + " |")
    mem = result["activation_memory"]
    lines += [
        "",
        f"Activation memory saved for backward ({mem['layers']} linears, {mem['tokens']} tokens x {mem['dim']}): "
        f"BF16 {mem['bf16_bytes'] / 2**20:.2f} MiB, FP8 {mem['fp8_bytes'] / 2**20:.2f} MiB "
        f"({100 * mem['saved_fraction']:.1f}% saved).",
    ]
    return "\n".join(lines)


def _cell(m: dict) -> str:
    return f"{m['rel_rmse']:.3f} / {m['median_channel_rel_rmse']:.3f} / {m['flushed_to_zero']:.3f}"


def print_rich(result: dict) -> None:
    """One row per tensor and scaling scheme (the three errors side by side in one cell broke over three
    lines at 80 columns); a rule separates the tensors."""
    console = Console()
    rows, ends = [], []
    for row in result["quantization_error"]:
        scale = "-" if row["outlier_scale"] is None else f"{row['outlier_scale']:g}"
        for i, scheme in enumerate(SCHEMES):
            m = row["schemes"][scheme]
            label = [row["tensor"], scale, str(row["outlier_channels"])] if i == 0 else ["", "", ""]
            rows.append([*label, scheme, f"{m['rel_rmse']:.3f}", f"{m['median_channel_rel_rmse']:.3f}",
                         f"{m['flushed_to_zero']:.3f}"])
        ends.append(len(rows) - 1)
    headers = ["tensor", "outlier scale", "outliers", "scaling", "rel RMSE", "median channel rel RMSE",
               "flushed to zero"]
    table = fitted_table(headers, rows, console.width, left=(0, 3), section_ends=set(ends[:-1]))
    console.print("FP8 E4M3 quantization error", style="bold", highlight=False)
    console.print(table)
    console.print(markdown(result).splitlines()[-1], highlight=False)


def write_plot(result: dict, path: Path) -> None:
    """Median per-channel relative RMSE versus outlier scale (synthetic rows), one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["quantization_error"] if r["outlier_scale"] is not None]
    if not rows:
        raise DSV3Error("--plot needs synthetic rows (give --outlier-scales)")
    xs = [max(r["outlier_scale"], 1.0) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for scheme in SCHEMES:
        ax.plot(xs, [r["schemes"][scheme]["median_channel_rel_rmse"] for r in rows], "o-", label=scheme)
    ax.set(xscale="log", yscale="log", xlabel="outlier channel scale (1 = no outliers)")
    ax.set_ylabel("median channel relative RMSE")
    ax.set_title("E4M3 round trip of activations with outlier channels")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def parse_scales(text: str) -> list[float]:
    scales = parse_list(text, "--outlier-scales", float)
    if any(s < 0 or s > 1e6 for s in scales):
        raise DSV3Error("--outlier-scales must lie in 0..1e6 (0 means no outliers)")
    return scales


def parse_seeds(text: str) -> list[int]:
    return parse_list(text, "--seeds", int)


def _emit(result: dict, as_json: bool, as_markdown: bool, text: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif as_markdown:
        sys.stdout.write(text + "\n")
    else:
        print_training_rich(result["training_comparison"])


def print_training_rich(training: dict) -> None:
    """The training comparison as a table sized to the terminal (the Markdown text, printed as it was,
    broke its rows across lines at 80 columns)."""
    console = Console()
    o = training["options"]
    rows = []
    for v, s in training["summary"].items():
        gap = s["mean_rel_gap_to_bf16"]
        rows.append([v, ", ".join(f"{x:.4f}" for x in s["val_loss"]), f"{s['mean_val_loss']:.4f}",
                     ", ".join(f"{100 * g:+.2f}%" for g in s["rel_gap_to_bf16"]),
                     "-" if gap is None else f"{100 * gap:+.2f}%"])
    console.print(f"FP8 training: {o.get('steps')} steps of {o.get('batch_size')} x {o.get('seq_len')} tokens, "
                  f"seeds {training['seeds']}", style="bold", highlight=False)
    headers = ["variant", "final val loss per seed", "mean", "gap to BF16 per seed", "mean gap"]
    console.print(fitted_table(headers, rows, console.width))
    if training["bf16_seed_spread"] is not None:
        console.print(f"Run-to-run spread of BF16 over seeds: {100 * training['bf16_seed_spread']:.2f}%.",
                      highlight=False)


def main(
    activations: Path | None = typer.Option(None, help="A .pt file of captured activations (tensor or dict)."),
    capture_from: Path | None = typer.Option(
        None, help="A trained checkpoint folder: capture its Linear inputs on stdlib text and tabulate those."
    ),
    capture_batches: int = typer.Option(4, help="--capture-from: sequences of --seq-len tokens to run."),
    tokens: int = typer.Option(4096, help="Synthetic activations: tokens."),
    dim: int = typer.Option(2048, help="Synthetic activations: channels."),
    outlier_scales: str = typer.Option("0,10,100,1000,10000", help="Synthetic outlier channel scales (0: none)."),
    outlier_channels_count: int = typer.Option(8, "--outlier-channels", help="Synthetic outlier channels."),
    memory_layers: int = typer.Option(4, help="Linears in the activation-memory measurement."),
    seed: int = typer.Option(0, help="Random seed."),
    train: bool = typer.Option(False, "--train", help="Compare BF16, fine FP8 and per-tensor FP8 training."),
    steps: int = typer.Option(100, help="--train: optimizer steps per run."),
    seeds: str = typer.Option("0", help="--train: comma-separated seeds (each runs every variant)."),
    preset: str = typer.Option("nano", help="--train: model preset."),
    batch_size: int = typer.Option(8, help="--train: sequences per step."),
    seq_len: int = typer.Option(256, help="--train / --capture-from: tokens per sequence."),
    eval_every: int = typer.Option(25, help="--train: held-out evaluation interval (and at the end)."),
    eval_tokens: int = typer.Option(16384, help="--train: held-out tokens per evaluation."),
    threads: int = typer.Option(1, help="--train: torch CPU threads (0: torch's default)."),
    runs_dir: Path = typer.Option(Path("runs/fp8_study"), help="--train: where the runs' folders go."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_markdown: bool = typer.Option(False, "--markdown", help="Print Markdown tables."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG: error vs outlier scale, or the loss curves with --train."
    ),
) -> None:
    """FP8 study: quantization error of per-tensor, per-row and 1x128 scaling; FP8 activation memory;
    with --train, BF16 vs fine-grained vs per-tensor FP8 training loss."""
    if min(tokens, dim, memory_layers, steps, batch_size, seq_len, eval_every, eval_tokens, capture_batches) < 1:
        raise DSV3Error("sizes, --steps, --batch-size, --seq-len, --eval-every and --eval-tokens must be positive")
    if outlier_channels_count < 0 or threads < 0:
        raise DSV3Error("--outlier-channels and --threads must be non-negative")
    if train:
        options = dict(
            preset=preset, steps=steps, batch_size=batch_size, seq_len=seq_len,
            eval_every=eval_every, eval_tokens=eval_tokens, threads=threads, log_every=max(1, steps // 10),
        )
        training = compare_training(parse_seeds(seeds), runs_dir, **options)
        result = {"study": "fp8", "training_comparison": training}
        if plot is not None:
            write_training_plot(training, plot)
            result["plot"] = str(plot)
        _emit(result, as_json, as_markdown, training_markdown(training))
        return
    rows = []
    if activations is not None:
        rows += quantization_rows(load_activations(activations), None)
    if capture_from is not None:
        from dsv3.studies.fp8_capture import capture_activations, real_activation_rows

        captured = capture_activations(capture_from, capture_batches, seq_len, seed)
        rows += real_activation_rows(captured, seed)
    for scale in parse_scales(outlier_scales) if activations is None and capture_from is None else []:
        x = synthetic_activations(tokens, dim, scale, outlier_channels_count, seed)
        rows += quantization_rows({"synthetic": x}, scale)
    result = {
        "study": "fp8",
        "quantization_error": rows,
        "activation_memory": activation_memory(min(tokens, 2048), min(dim, 2048), memory_layers, seed),
    }
    if plot is not None:
        write_plot(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif as_markdown:
        sys.stdout.write(markdown(result) + "\n")
    else:
        print_rich(result)
