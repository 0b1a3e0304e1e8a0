"""PNG plots: KV cache versus context, the EP TPOT bound versus interconnect bandwidth, active versus total.

Each plot is written atomically (temp file in the same folder, then rename), so a failed run never
leaves half a PNG behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dsv3.analysis import bounds, memory
from dsv3.analysis.arch import Architecture, load_architecture
from dsv3.analysis.hardware import Hardware
from dsv3.analysis.params import count_params
from dsv3.analysis.public_models import public_architectures
from dsv3.errors import DSV3Error
from dsv3.io import save_figure

PAPER_MODELS = ("deepseek-v3", "qwen2.5-72b", "llama-3.1-405b")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    return save_figure(fig, path)


def plot_kv_cache(out_dir: Path, extra: Architecture | None = None, kv_dtype: str = "bf16") -> Path:
    """KV cache of one sequence versus context length, for the paper's three models (+ the analyzed one)."""
    plt, fig, ax = _figure()
    archs = [load_architecture(n) for n in PAPER_MODELS]
    if extra is not None and extra.name not in PAPER_MODELS:
        archs.append(extra)
    context = np.linspace(0, 131072, 257)
    for arch in archs:
        per_token = memory.kv_bytes_per_token(arch, kv_dtype)
        ax.plot(context / 1024, per_token * context / 1e9,
                label=f"{arch.name} ({arch.attention.kind.upper()}, {per_token / 1000:.3f} KB/token)")
    ax.set_xlabel("context length (K tokens)")
    ax.set_ylabel(f"KV cache per sequence (GB, {kv_dtype})")
    ax.set_title("KV cache versus context (ISCA Table 1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "kv_cache_vs_context.png")


def plot_tpot_vs_bandwidth(out_dir: Path, hardware: list[Hardware], arch: Architecture | None = None) -> Path:
    """The EP decode bound (ISCA §2.3.2) over interconnect bandwidth, with each device's links marked."""
    plt, fig, ax = _figure()
    bw = np.logspace(np.log10(5), np.log10(2000), 200)
    paper = [bounds.ep_decode_bound(b).tpot_s * 1e3 for b in bw]
    ax.loglog(bw, paper, label="paper assumptions (hidden 7000, 9 experts, 61 layers)")
    if arch is not None and arch.is_moe:
        ax.loglog(bw, [bounds.ep_decode_bound_for(arch, b).tpot_s * 1e3 for b in bw], "--", label=arch.name)
    marks: dict[float, list[str]] = {}
    for hw in hardware:
        if hw.scale_out_gbs > 0:
            marks.setdefault(hw.scale_out_gbs, []).append(f"{hw.name} out")
        if hw.scale_up_gbs > 0 and hw.scale_up_domain > 1:
            marks.setdefault(hw.scale_up_gbs, []).append(f"{hw.name} up")
    for value, names in sorted(marks.items()):
        tpot = bounds.ep_decode_bound(value).tpot_s * 1e3
        ax.plot([value], [tpot], "o", color="black", markersize=4)
        ax.annotate(", ".join(names), (value, tpot), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set_xlabel("interconnect bandwidth per device, one direction (GB/s)")
    ax.set_ylabel("TPOT upper-bound time (ms)")
    ax.set_title("EP decode bound: TPOT versus interconnect bandwidth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "tpot_vs_bandwidth.png")


def _label_offset(point: tuple[float, float, str], points: list[tuple[float, float, str]]) -> tuple[int, int]:
    """Where a point's label goes: beside it, or, when another point sits almost on it (V2 and
    Qwen3-235B, both about 236B total and 21B active), above for the upper one and below for the
    lower, so the two names do not print over each other."""
    x, y, name = point
    near = [(py, pname) for px, py, pname in points if pname != name
            and abs(np.log10(px / x)) < 0.08 and abs(np.log10(py / y)) < 0.2]
    if not near:
        return (5, 2)
    return (5, 5) if (y, name) > max(near) else (5, -12)


def plot_active_vs_total(out_dir: Path, extra: Architecture | None = None) -> Path:
    """Activated versus total parameters of public models: MoE models sit far below the diagonal."""
    plt, fig, ax = _figure()
    archs = public_architectures()
    if extra is not None and extra.name not in {a.name for a in archs}:
        archs.append(extra)
    points = []
    for arch in archs:
        c = count_params(arch)
        points.append((c.total_params / 1e9, c.active_params / 1e9, arch.name))
        ax.scatter([points[-1][0]], [points[-1][1]], color="tab:red" if arch.is_moe else "tab:blue", s=20)
    for point in points:
        ax.annotate(point[2], point[:2], textcoords="offset points", xytext=_label_offset(point, points), fontsize=7)
    line = np.array([1, 1000])
    ax.loglog(line, line, ":", color="gray", label="dense (active = total)")
    ax.set_xlabel("total parameters (B)")
    ax.set_ylabel("activated parameters per token (B)")
    ax.set_title("Activated versus total parameters (red: MoE, blue: dense)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "active_vs_total.png")


def write_plots(out_dir: str | os.PathLike, hardware: list[Hardware], arch: Architecture | None = None,
                kv_dtype: str = "bf16") -> list[Path]:
    """All three plots into `out_dir` (created if needed); returns the paths written."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DSV3Error(f"cannot create plot folder {out}: {exc}") from None
    return [plot_kv_cache(out, arch, kv_dtype), plot_tpot_vs_bandwidth(out, hardware, arch),
            plot_active_vs_total(out, arch)]
