"""`dsv3 analyze` and `dsv3 paper`: thin Typer front ends over the analysis layer.

Output is rich tables by default, one JSON object with --json (nothing else on stdout), or Markdown
with --markdown; --plot-dir writes the PNG plots. Bad input raises DSV3Error (exit 2 via dsv3.cli).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from dsv3.analysis.arch import load_architecture
from dsv3.analysis.hardware import resolve_hardware
from dsv3.analysis.paper import paper_rows
from dsv3.analysis.render import analyze_sections, paper_sections, print_rich, to_markdown
from dsv3.analysis.report import CONVENTIONS, AnalyzeOptions, analyze
from dsv3.errors import DSV3Error

analyze_app = typer.Typer(add_completion=False, help="Memory, FLOPs and speed bounds of any model on any hardware.")
paper_app = typer.Typer(add_completion=False, help="The paper's numbers side by side with ours.")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
MarkdownOpt = Annotated[bool, typer.Option("--markdown", help="Print Markdown tables.")]
PriceOpt = Annotated[float | None, typer.Option(help="Rental USD per GPU-hour (default: the preset's, else 2).")]
PlotDirOpt = Annotated[Path | None, typer.Option("--plot-dir", help="Write PNG plots into this folder.")]


def _check_format(as_json: bool, markdown: bool) -> None:
    if as_json and markdown:
        raise DSV3Error("choose one of --json and --markdown")


def _emit(sections, payload: dict, as_json: bool, markdown: bool, title: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload) + "\n")
    elif markdown:
        sys.stdout.write(to_markdown(sections, title))
    else:
        print_rich(sections)


def _plots(plot_dir: Path | None, hardware, arch=None, kv_dtype: str = "bf16") -> list[str]:
    if plot_dir is None:
        return []
    from dsv3.analysis.plots import write_plots

    paths = [str(p) for p in write_plots(plot_dir, hardware, arch, kv_dtype)]
    for p in paths:
        print(f"wrote {p}", file=sys.stderr)
    return paths


def _meta_check(source) -> dict:
    """DeepSeek configs: the analytic count against Transformer(cfg) built on the meta device."""
    from dsv3.analysis.meta_check import cross_check
    from dsv3.config import load_config

    pairs = cross_check(load_config(source))
    return {"agrees": all(a == m for a, m in pairs.values()),
            "by_category": {c: {"analytic": a, "meta_model": m} for c, (a, m) in pairs.items()}}


@analyze_app.command()
def analyze_command(
    preset: Annotated[str | None, typer.Option(help="A preset: deepseek-v3, deepseek-v2, deepseek-v2-lite, "
                                                     "nano, small, qwen2.5-72b, llama-3.1-405b.")] = None,
    config: Annotated[Path | None, typer.Option(help="A HF config.json or a folder holding one.")] = None,
    seq_len: Annotated[int, typer.Option(help="Sequence length for training/prefill FLOPs.")] = 4096,
    context: Annotated[int | None, typer.Option(help="Decode context for KV cache and decode bounds "
                                                     "(default: seq-len).")] = None,
    batch: Annotated[int, typer.Option(help="Sequences in the KV cache.")] = 1,
    kv_dtype: Annotated[str, typer.Option("--cache-dtype",
                                          help="KV cache dtype: bf16, fp16, fp8, int8, 4bit, fp32.")] = "bf16",
    weight_dtype: Annotated[str, typer.Option(help="Weight dtype for the local decode bound.")] = "4bit",
    hardware: Annotated[list[str] | None, typer.Option(help="Hardware preset or YAML/JSON file; repeatable "
                                                            "(default: all presets).")] = None,
    tokens_per_device: Annotated[int, typer.Option(help="EP bound: tokens per device per micro-batch.")] = 32,
    dispatch_bytes: Annotated[float, typer.Option(help="EP bound: bytes per dispatched element (FP8).")] = 1.0,
    combine_bytes: Annotated[float, typer.Option(help="EP bound: bytes per combined element (BF16).")] = 2.0,
    micro_batches: Annotated[int, typer.Option(help="EP bound: overlapped micro-batches.")] = 2,
    mtp_acceptance: Annotated[float, typer.Option(help="MTP draft acceptance rate.")] = 0.8,
    train_tokens: Annotated[float, typer.Option(help="Training tokens for the cost estimate.")] = 14.8e12,
    train_hardware: Annotated[str, typer.Option(help="Hardware preset or file for the training cost.")] = "h800",
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilization (ISCA Table 4 causal: 0.3894).")] = 0.3894,
    usd_per_gpu_hour: PriceOpt = None,
    as_json: JsonOpt = False,
    markdown: MarkdownOpt = False,
    plot_dir: PlotDirOpt = None,
) -> None:
    """Parameters, KV cache, weight memory, FLOPs per token, EP/MTP/local decode bounds and training cost."""
    _check_format(as_json, markdown)
    if (preset is None) == (config is None):
        raise DSV3Error("give exactly one of --preset NAME and --config FILE")
    arch = load_architecture(preset if preset is not None else config)
    devices = resolve_hardware(hardware)
    train_hw = resolve_hardware([train_hardware])[0]
    opts = AnalyzeOptions(seq_len=seq_len, context=context, batch=batch, kv_dtype=kv_dtype,
                          weight_dtype=weight_dtype, tokens_per_device=tokens_per_device,
                          dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, micro_batches=micro_batches,
                          mtp_acceptance=mtp_acceptance, train_tokens=train_tokens, mfu=mfu,
                          usd_per_gpu_hour=usd_per_gpu_hour)
    report = analyze(arch, devices, train_hw, opts)
    if arch.attention.kind == "mla":
        report["meta_check"] = _meta_check(preset if preset is not None else config)
    report["plots"] = _plots(plot_dir, devices, arch, kv_dtype)
    _emit(analyze_sections(report), report, as_json, markdown, f"dsv3 analyze: {arch.name}")


@paper_app.command()
def paper_command(as_json: JsonOpt = False, markdown: MarkdownOpt = False, plot_dir: PlotDirOpt = None) -> None:
    """Every number of the paper's co-design arithmetic: the paper's value, ours, the difference, notes."""
    _check_format(as_json, markdown)
    rows = paper_rows()
    plots = _plots(plot_dir, resolve_hardware(None))
    payload = {"rows": [r.as_dict() for r in rows], "conventions": CONVENTIONS, "plots": plots}
    _emit(paper_sections(rows), payload, as_json, markdown, "dsv3 paper: the paper's numbers and ours")
