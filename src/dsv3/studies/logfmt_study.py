"""`dsv3 study logfmt`: how much each candidate MoE-combine format loses (ISCA 2025 §3.2).

Every format rounds the same float32 data: BF16, E4M3 and E5M2 with one amax scale per 1x128 tile, and
LogFMT-8/10 (plus LogFMT-8 rounded in log space, the variant the paper rejects for its bias). Data: Gaussian,
Student-t (heavy tails), uniform, tensors saved with torch.save (--activations), and the routed experts' outputs
of a trained checkpoint on held-out text (--capture-from). With --train: the paper's training experiment, one
trainer run per (format, seed) with the MoE combine rounded through the format. Torch is imported only when the
study runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from dsv3.errors import DSV3Error
from dsv3.io import save_figure
from dsv3.option_lists import parse_list

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
    """The data set heads each group of rows (as its own row) instead of filling a column of its own,
    which at 80 columns cut 'student-t(df=3)' to 'student-t(…'."""
    from rich.console import Console

    from dsv3.termtable import fitted_table

    console = Console()
    rows, ends, previous = [], set(), None
    for row in result["rows"]:
        if row["data"] != previous:
            if rows:
                ends.add(len(rows) - 1)
            rows.append([row["data"], "", "", "", ""])
            previous = row["data"]
        rows.append([f"  {row['format']}", f"{row['bits_per_element']:.2f}", f"{row['rel_rmse']:.2e}",
                     f"{row['mean_bias']:+.1e}", f"{row['magnitude_bias']:+.1e}"])
    headers = ["data / format", "bits per element", "rel. RMSE", "mean bias", "magnitude bias"]
    console.print("rounding error of MoE-combine formats (biases relative to mean |x|)", style="bold",
                  highlight=False)
    console.print(fitted_table(headers, rows, console.width, section_ends=ends))


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
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=20, ha="right")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = ax_rmse.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(formats), fontsize=8)
    fig.suptitle("MoE-combine formats, 1x128 tiles (LogFMT: ISCA 2025 §3.2)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    if not path.parent.is_dir():
        raise DSV3Error(f"--plot: directory does not exist: {path.parent}")
    save_figure(fig, path, dpi=120)


# ---- real MoE outputs: captured from a trained checkpoint --------------------------------------------


def held_out_token_ids(tokenizer, eos_id: int, n_tokens: int):
    """The first n_tokens of the standard library's held-out split (the trainer's split rule), documents
    joined by end-of-text as the trainer packs them: text the checkpoint never trained on."""
    import torch

    from dsv3.data import load_corpus

    ids: list[int] = []
    for doc in load_corpus(None).val:
        ids.extend(tokenizer.encode(doc.text).ids + [eos_id])
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise DSV3Error(f"the held-out split has only {len(ids)} tokens; lower --capture-batches")
    return torch.tensor(ids[:n_tokens])


def capture_moe_outputs(checkpoint: Path, batches: int, seq_len: int) -> tuple[dict, dict]:
    """Run `batches` x [1, seq_len] held-out windows through the checkpoint and keep every main-layer
    routed-expert output ([tokens, hidden], float32), named "moe-out:layer L". Also returns, per layer,
    RMS(routed output) / RMS(residual stream entering the layer): how much of the stream the combine
    format can perturb."""
    import torch
    from tokenizers import Tokenizer

    from dsv3 import load_pretrained
    from dsv3.model.moe import MoE

    if not (checkpoint / "config.json").is_file() or not (checkpoint / "tokenizer.json").is_file():
        raise DSV3Error(f"--capture-from: {checkpoint} is not a checkpoint folder (config.json, tokenizer.json)")
    model = load_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    seq_len = min(seq_len, model.config.max_position_embeddings)
    ids = held_out_token_ids(tokenizer, model.config.eos_token_id, batches * seq_len).view(batches, seq_len)
    outputs: dict[str, list] = {}
    residual_rms: dict[str, list] = {}
    handles = []
    for i, block in enumerate(model.main_layers):
        if not isinstance(block.mlp, MoE):
            continue
        name = f"moe-out:layer {i}"
        outputs[name], residual_rms[name] = [], []
        handles.append(
            block.mlp.experts.register_forward_hook(
                lambda _m, _i, out, name=name: outputs[name].append(out.detach().clone())
            )
        )
        handles.append(
            block.register_forward_pre_hook(
                lambda _m, args, name=name: residual_rms[name].append(args[0].detach().square().mean())
            )
        )
    with torch.no_grad():
        for window in ids:
            model(window.unsqueeze(0))
    for handle in handles:
        handle.remove()
    data = {name: torch.cat(chunks) for name, chunks in outputs.items()}
    share = {name: (data[name].square().mean() / torch.stack(residual_rms[name]).mean()).sqrt().item() for name in data}
    return data, share


# ---- the training experiment: the MoE combine's format in the forward pass -----------------------------

TRAIN_FORMATS = ("fp32", "bf16", "e4m3", "e5m2", "logfmt8", "logfmt10")  # fp32: no rounding at all
BASELINE = "bf16"


def training_options(fmt: str, seed: int, settings: dict, out: Path):
    """One run's TrainOptions: everything but the combine format and the seed is shared by all runs."""
    from dsv3.train.options import TrainOptions

    return TrainOptions(
        preset=settings["preset"],
        config=settings.get("config"),
        data=list(settings.get("data") or []),
        out=str(out),
        steps=settings["steps"],
        batch_size=settings["batch_size"],
        seq_len=settings["seq_len"],
        lr=settings["lr"],
        seed=seed,
        eval_tokens=settings["eval_tokens"],
        moe_output_format=None if fmt == "fp32" else fmt,
        eval_every=settings["steps"],
        save_every=settings["steps"],
        keep_last=1,
        log_every=max(1, settings["steps"] // 10),
        cache_dir=settings.get("cache_dir"),
        threads=settings["threads"],
    )


def train_one(fmt: str, seed: int, settings: dict, on_step=None) -> dict:
    """Train one (format, seed) run in a throwaway folder with the trainer's Python API; its numbers.
    ``on_step(row)`` sees every step (the study's progress bar)."""
    import tempfile

    from dsv3.studies.progress import finished
    from dsv3.train.run import run_training

    with tempfile.TemporaryDirectory(prefix="dsv3-logfmt-") as folder:
        summary = run_training(
            training_options(fmt, seed, settings, Path(folder) / "run"), on_step=on_step, show_progress=False,
            plots=False,
        )
    summary = finished(summary, f"{fmt}, seed {seed}")
    keys = ("first_loss", "final_loss", "val_loss", "val_bpb", "train_seconds", "skipped_steps", "tokens")
    return {"format": fmt, "seed": seed, **{k: summary[k] for k in keys}}


def summarize_runs(runs: list[dict], formats: list[str], seeds: list[int]) -> dict:
    """Per format: mean, sample std, min and max of the final validation loss over seeds, and the
    difference to the BF16 run of the same seed (same init and data order, so the paired difference
    cancels most of the seed-to-seed spread)."""
    import statistics

    by_cell = {(r["format"], r["seed"]): r["val_loss"] for r in runs}
    summary = {}
    for fmt in formats:
        losses = [by_cell[fmt, s] for s in seeds]
        cell = {
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "val_loss_min": min(losses),
            "val_loss_max": max(losses),
            "val_loss_per_seed": dict(zip(map(str, seeds), losses, strict=True)),
        }
        if BASELINE in formats:
            deltas = [by_cell[fmt, s] - by_cell[BASELINE, s] for s in seeds]
            cell["delta_vs_bf16_mean"] = statistics.fmean(deltas)
            cell["delta_vs_bf16_std"] = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
        summary[fmt] = cell
    return summary


def run_training_study(formats: list[str], seeds: list[int], settings: dict) -> dict:
    """Every (format, seed) run, seed-major so a partial sweep still compares all formats."""
    from dsv3.studies.progress import RunsProgress

    runs = []
    with RunsProgress("logfmt study", len(seeds) * len(formats), settings["steps"]) as progress:
        for seed in seeds:
            for fmt in formats:
                run = train_one(fmt, seed, settings, progress.start_run(f"{fmt}, seed {seed}"))
                progress.note(f"seed {seed} {fmt}: val loss {run['val_loss']:.4f} ({run['train_seconds']:.0f}s)")
                runs.append(run)
    return {
        "study": "logfmt-train",
        "config": {**settings, "formats": formats, "seeds": seeds},
        "quantized": "routed-expert output of every MoE layer (the combine of its dsv3.model.dispatch."
        "LocalDispatcher, before the shared expert is added), forward only, straight-through gradient, in "
        "training and evaluation",
        "runs": runs,
        "summary": summarize_runs(runs, formats, seeds),
    }


def _train_rows(result: dict):
    """(format, cell, "mean ± std", "Δ vs bf16", "per seed") per format, shared by both renderings."""
    seeds = result["config"]["seeds"]
    for fmt, cell in result["summary"].items():
        delta = (
            f"{cell['delta_vs_bf16_mean']:+.4f} ± {cell['delta_vs_bf16_std']:.4f}"
            if "delta_vs_bf16_mean" in cell
            else "-"
        )
        per_seed = ", ".join(f"{cell['val_loss_per_seed'][str(s)]:.4f}" for s in seeds)
        yield fmt, cell, f"{cell['val_loss_mean']:.4f} ± {cell['val_loss_std']:.4f}", delta, per_seed


def train_markdown(result: dict) -> str:
    lines = [
        "| format | val loss, mean ± std | min .. max | Δ vs bf16 (paired), mean ± std | per seed |",
        "|---|---:|---:|---:|---|",
    ]
    for fmt, cell, mean, delta, per_seed in _train_rows(result):
        span = f"{cell['val_loss_min']:.4f} .. {cell['val_loss_max']:.4f}"
        lines.append(f"| {fmt} | {mean} | {span} | {delta} | {per_seed} |")
    return "\n".join(lines)


def print_train_rich(result: dict) -> None:
    from rich.console import Console

    from dsv3.termtable import fitted_table

    console = Console()
    seeds = result["config"]["seeds"]
    rows = [[fmt, mean, delta, per_seed] for fmt, _, mean, delta, per_seed in _train_rows(result)]
    console.print(f"final validation loss by MoE-combine format ({len(seeds)} seeds)", style="bold", highlight=False)
    console.print(fitted_table(["format", "val loss mean ± std", "Δ vs bf16 (paired)", "per seed"], rows,
                               console.width))


def write_train_plot(result: dict, path: Path) -> None:
    """Left: each seed's final validation loss per format (points) with the mean. Right: the paired
    difference to BF16 per seed, with its mean: the view where seed noise mostly cancels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds, summary = result["config"]["seeds"], result["summary"]
    formats = list(summary)
    by_cell = {(r["format"], r["seed"]): r["val_loss"] for r in result["runs"]}
    fig, (ax_loss, ax_delta) = plt.subplots(1, 2, figsize=(11, 4.4))
    for j, seed in enumerate(seeds):
        offsets = [i + (j - (len(seeds) - 1) / 2) * 0.08 for i in range(len(formats))]
        ax_loss.scatter(offsets, [by_cell[f, seed] for f in formats], s=18, label=f"seed {seed}")
        if BASELINE in formats:
            deltas = [by_cell[f, seed] - by_cell[BASELINE, seed] for f in formats]
            ax_delta.scatter(offsets, deltas, s=18, label=f"seed {seed}")
    ax_loss.scatter(
        range(len(formats)),
        [summary[f]["val_loss_mean"] for f in formats],
        marker="_",
        s=400,
        color="black",
        label="mean",
    )
    if BASELINE in formats:
        ax_delta.scatter(
            range(len(formats)),
            [summary[f]["delta_vs_bf16_mean"] for f in formats],
            marker="_",
            s=400,
            color="black",
            label="mean",
        )
        ax_delta.axhline(0, color="black", linewidth=0.8)
    ax_loss.set(ylabel="final validation loss (nats/token)", title="validation loss per run")
    ax_delta.set(ylabel="val loss - bf16 val loss (same seed)", title="paired difference to BF16")
    for ax in (ax_loss, ax_delta):
        ax.set_xticks(range(len(formats)), formats)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(
        f"MoE combine format in training: {cfg['preset'] if not cfg.get('config') else 'custom'} model, "
        f"{cfg['steps']} steps x {cfg['batch_size']} x {cfg['seq_len']} tokens"
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(
    numel: int = typer.Option(1 << 20, help="Elements per synthetic data set (rows of 4096)."),
    df: int = typer.Option(3, help="Degrees of freedom of the Student-t data (1..30)."),
    activations: Path | None = typer.Option(
        None, "--activations", help="A torch.save'd tensor (or dict of tensors), e.g. captured MoE outputs."
    ),
    capture_from: Path | None = typer.Option(
        None, "--capture-from", help="A trained checkpoint folder: add its routed-expert outputs on held-out text."
    ),
    capture_batches: int = typer.Option(4, help="Held-out windows run through --capture-from."),
    capture_seq_len: int = typer.Option(256, help="Tokens per captured window."),
    seed: int = typer.Option(0, help="Random seed of the synthetic data."),
    train: bool = typer.Option(False, "--train", help="Run the training experiment instead of the error table."),
    formats: str = typer.Option(",".join(TRAIN_FORMATS), help="--train: combine formats (fp32 = no rounding)."),
    seeds: str = typer.Option("0,1,2", help="--train: seeds, one run per format and seed."),
    steps: int = typer.Option(150, help="--train: optimizer steps per run."),
    preset: str = typer.Option("nano", help="--train: model preset."),
    config: Path | None = typer.Option(None, "--config", help="--train: a config.json instead of --preset."),
    data: list[str] = typer.Option([], "--data", help="--train: training data (default: the stdlib)."),
    batch_size: int = typer.Option(8, help="--train: sequences per step."),
    seq_len: int = typer.Option(128, help="--train: tokens per sequence."),
    lr: float = typer.Option(2e-3, help="--train: peak learning rate."),
    eval_tokens: int = typer.Option(16384, help="--train: held-out tokens of the final evaluation."),
    threads: int = typer.Option(1, help="--train: torch CPU threads (0: torch's default)."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="--train: tokenizer/token cache."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of the table."),
) -> None:
    """Relative RMSE and bias of LogFMT-8/10, E4M3, E5M2 (1x128 scaling) and BF16 on the same data; with
    --train, the final validation loss of training runs whose MoE combine rounds through each format."""
    if as_json and markdown:
        raise DSV3Error("choose one of --json and --markdown")
    if plot is not None and not plot.parent.is_dir():
        raise DSV3Error(f"--plot: directory does not exist: {plot.parent}")
    if train:
        result = _train_study(
            formats, seeds, steps, preset, config, data, batch_size, seq_len, lr, eval_tokens, threads, cache_dir
        )
        show, table, draw = print_train_rich, train_markdown, write_train_plot
    else:
        result = _error_study(numel, df, activations, capture_from, capture_batches, capture_seq_len, seed)
        show, table, draw = print_rich, markdown_table, write_plot
    if plot is not None:
        draw(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif markdown:
        sys.stdout.write(table(result) + "\n")
    else:
        show(result)


def _error_study(numel, df, activations, capture_from, capture_batches, capture_seq_len, seed) -> dict:
    if not 4096 <= numel <= 1 << 26:
        raise DSV3Error(f"--numel must lie in 4096..{1 << 26}, got {numel}")
    if not 1 <= df <= 30:
        raise DSV3Error(f"--df must lie in 1..30, got {df}")
    if not 1 <= capture_batches <= 256 or not 2 <= capture_seq_len <= 8192:
        raise DSV3Error("--capture-batches must lie in 1..256 and --capture-seq-len in 2..8192")
    data = synthetic_data(numel, df, seed)
    if activations is not None:
        data.update(load_activations(activations))
    share = None
    if capture_from is not None:
        captured, share = capture_moe_outputs(capture_from, capture_batches, capture_seq_len)
        data.update(captured)
    config = {
        "numel": numel,
        "df": df,
        "seed": seed,
        "activations": str(activations) if activations else None,
        "capture_from": str(capture_from) if capture_from else None,
        "capture_batches": capture_batches,
        "capture_seq_len": capture_seq_len,
    }
    result = run_study(data, config)
    if share is not None:
        result["routed_rms_over_residual_rms"] = share
    return result


def _train_study(
    formats, seeds, steps, preset, config, data, batch_size, seq_len, lr, eval_tokens, threads, cache_dir
) -> dict:
    format_list = parse_list(formats, "--formats")
    unknown = [f for f in format_list if f not in TRAIN_FORMATS]
    if unknown:
        raise DSV3Error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(TRAIN_FORMATS)}")
    seed_list = parse_list(seeds, "--seeds", int)
    if steps < 1 or batch_size < 1 or seq_len < 2 or eval_tokens < 1 or threads < 0:
        raise DSV3Error("--steps, --batch-size, --eval-tokens must be >= 1, --seq-len >= 2, --threads >= 0")
    if config is not None and not config.exists():
        raise DSV3Error(f"--config not found: {config}")
    settings = {
        "preset": preset,
        "config": str(config) if config else None,
        "data": list(data),
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "eval_tokens": eval_tokens,
        "threads": threads,
        "cache_dir": str(cache_dir) if cache_dir else None,
    }
    return run_training_study(format_list, seed_list, settings)
