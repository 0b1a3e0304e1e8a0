"""PNG charts of `dsv3 plan`: the step-time breakdown, memory per GPU per layout, tokens/day versus NIC speed,
and for `plan serve` decode latency and throughput versus the batch per GPU.

matplotlib is imported inside each function, so `dsv3 plan` without --plot-dir never loads it; each PNG
is written atomically (dsv3.io.save_figure).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dsv3.analysis.plan import GB, TABLE4, TrainPlan, label, plan_train
from dsv3.errors import DSV3Error
from dsv3.io import save_figure

PARTS = ("1F", "1B", "1W", "1F1B", "bubble", "opt")


def _figure(width: float = 7.5, height: float = 4.2, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height), dpi=120)


def _folder(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DSV3Error(f"cannot create plot folder {path.parent}: {exc}") from None


def plot_breakdown(plan: TrainPlan, path: Path) -> Path:
    """One horizontal stacked bar per source: the planner's step and, for V3's layout, Table 4's."""
    _folder(path)
    fig, ax = _figure(height=2.8)
    rows = [("planner", plan.breakdown)]
    if label(plan.layout) == "PP16 dualpipe EP64 zero1" and plan.dp == 128:
        rows.append(("ISCA Table 4", {k: TABLE4[f"{k}_s"] for k in PARTS}))
    colors = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860"]
    for y, (_name, parts) in enumerate(rows):
        left = 0.0
        for part, color in zip(PARTS, colors, strict=True):
            ax.barh(y, parts[part], left=left, color=color, label=part if y == 0 else None)
            left += parts[part]
        ax.text(left + 0.2, y, f"{left:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("seconds per optimizer step")
    ax.set_title(f"Step time, {label(plan.layout)}, DP{plan.dp}", fontsize=10)
    ax.set_xlim(0, max(sum(r[1][p] for p in PARTS) for r in rows) * 1.18)
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_memory(plans: list[TrainPlan], path: Path, capacity_gb: float) -> Path:
    """Stacked memory per GPU of the ranked layouts, with the device's capacity as a line."""
    _folder(path)
    fig, ax = _figure(height=4.6)
    parts = ("weights", "gradients", "optimizer", "activations", "reserve")
    labels = [label(p.layout) for p in plans]
    bottom = [0.0] * len(plans)
    for part in parts:
        values = [p.memory[part] / GB for p in plans]
        ax.bar(range(len(plans)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(capacity_gb, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"capacity {capacity_gb:.1f} GB", (len(plans) - 0.5, capacity_gb), xytext=(0, 3),
                textcoords="offset points", ha="right", fontsize=7)
    ax.set_xticks(range(len(plans)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("GB per GPU (busiest rank)")
    ax.set_title("Memory per GPU of the layouts that fit, best tokens/day first", fontsize=10)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.0))
    ax.set_ylim(0, max(max(bottom), capacity_gb) * 1.3)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_knob(arch, cluster, layout, seq_len, global_batch, prec, a, path: Path) -> Path:
    """Tokens/day versus the scale-out bandwidth, for the plan's layout (the other inputs held)."""
    _folder(path)
    fig, ax = _figure()
    speeds = [100, 200, 400, 800, 1600]
    for name, knobs in (("as given", cluster.knobs),
                        ("+ multicast and in-network reduce", replace(cluster.knobs, multicast=True,
                                                                      in_network_reduce=True))):
        days = []
        for s in speeds:
            cl = replace(cluster, knobs=replace(knobs, nic_gbps=float(s)))
            days.append(plan_train(arch, cl, layout, seq_len, global_batch, prec, a).tokens_per_day / 1e9)
        ax.plot(speeds, days, "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(speeds, [str(s) for s in speeds])
    ax.set_xlabel("NIC Gb/s per GPU per direction")
    ax.set_ylabel("B tokens/day")
    ax.set_title(f"Tokens/day versus scale-out bandwidth, {label(layout)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def _decode_batches(chosen: int) -> list[int]:
    """Powers of two from 8 to 512 and the batch asked for: the sweep the serving chart draws."""
    return sorted({2**i for i in range(3, 10)} | {chosen})


def _batch_panel(ax, batches: list[int], values: list[float], fits: list[bool], chosen: int, label: str) -> None:
    """One curve over the batch sweep (log2 axis), hollow where the batch does not fit, the chosen batch dotted."""
    ax.plot(batches, values, "-", color="#4C72B0", label=label)
    for b, v, fit in zip(batches, values, fits, strict=True):
        ax.plot(b, v, "o", color="#4C72B0", markerfacecolor="#4C72B0" if fit else "white")
    ax.axvline(chosen, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches], fontsize=8)
    ax.set_xlabel("decode sequences per GPU (--batch-per-gpu)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def plot_serve(arch, cluster, decode_gpus: int, opts, a, path: Path, published_per_node: float | None) -> Path:
    """Decode TPOT (with the EP communication bound under it) and output tokens/s per node versus the
    sequences each GPU decodes per step: the latency a user sees against what a node serves, the other
    inputs held. Batches whose KV cache and weights do not fit are drawn hollow."""
    from dsv3.analysis.plan_serve import decode

    _folder(path)
    batches = _decode_batches(opts.decode_batch)
    runs = [decode(arch, cluster, decode_gpus, replace(opts, decode_batch=b), a) for b in batches]
    fits = [r["fits"] for r in runs]
    fig, (left, right) = _figure(width=9.0, height=3.8, ncols=2)
    _batch_panel(left, batches, [r["tpot_ms"] for r in runs], fits, opts.decode_batch, "planner TPOT")
    left.plot(batches, [r["ep_comm_bound_tpot_ms"] for r in runs], "--", color="#C44E52",
              label="EP communication bound")
    if not all(fits):
        left.plot([], [], "o", color="#4C72B0", markerfacecolor="white", label="KV cache + weights exceed HBM")
    left.set(ylabel="TPOT (ms)")
    left.set_title("Time per output token", fontsize=10)
    left.legend(fontsize=7, loc="upper left")
    _batch_panel(right, batches, [r["tokens_per_s_per_node"] / 1e3 for r in runs], fits, opts.decode_batch,
                 "planner")
    if published_per_node is not None:
        right.axhline(published_per_node / 1e3, color="black", linestyle="--", linewidth=1,
                      label=f"published {published_per_node / 1e3:.1f}k (24 h average)")
    right.set(ylabel="output tokens/s per node (thousands)")
    right.set_title("Decode throughput per node", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{arch.name} decode on {decode_gpus} {cluster.hardware.name} GPUs (EP{decode_gpus}), "
                 f"context {opts.context}; dotted: --batch-per-gpu {opts.decode_batch}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
