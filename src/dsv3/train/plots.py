"""End-of-run pictures from metrics.jsonl: the loss curve (train, MTP, held-out) and the expert-load
heatmap (each MoE layer's per-expert load relative to the mean, over training steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dsv3.io import save_figure

HEATMAP_COLUMNS = 120  # steps are averaged into at most this many columns


def write_plots(
    rows: list[dict[str, Any]], run_dir: Path, moe_names: list[str] | None = None
) -> dict[str, str]:
    """Write loss_curve.png and expert_load.png (when the model has MoE layers); returns their paths.
    ``moe_names`` labels the heatmap's rows (one per MoE layer, in metrics order)."""
    import matplotlib

    matplotlib.use("Agg")
    train = [r for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
    if not train:
        return {}
    out = {
        "loss_curve": str(
            _save(
                _loss_figure(train, [r for r in rows if r.get("kind") == "eval"]),
                Path(run_dir) / "loss_curve.png",
            )
        )
    }
    loads = [(r["step"], np.asarray(r["expert_load"], dtype=float)) for r in train if r.get("expert_load")]
    if loads:
        out["expert_load"] = str(_save(_load_figure(loads, moe_names), Path(run_dir) / "expert_load.png"))
    return out


def _loss_figure(train, evals):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in train]
    # The MTP loss tracks the train loss closely; drawn last and as noisy as it, it hid the train line. So
    # MTP is a smoothed dashed line underneath, and the train loss (raw, faint; smoothed, bold) is on top.
    mtp = [(r["step"], r["mtp_loss"]) for r in train if r.get("mtp_loss")]
    if mtp:
        mtp_steps, mtp_loss = zip(*mtp, strict=True)
        ax.plot(mtp_steps, _smooth(list(mtp_loss)), color="tab:green", ls="--", lw=1.2, zorder=2,
                label="MTP (token after next), smoothed")
    ax.plot(steps, [r["loss"] for r in train], color="tab:blue", lw=0.7, alpha=0.35, zorder=3,
            label="train (next token)")
    ax.plot(steps, _smooth([r["loss"] for r in train]), color="tab:blue", lw=2.0, zorder=4, label="train, smoothed")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color="tab:red", zorder=5,
                label="held out")
        ax.set_title(
            f"final held-out: {evals[-1]['val_loss']:.3f} nats/token, {evals[-1]['val_bpb']:.3f} bits/byte"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _load_figure(loads, names):
    import matplotlib.pyplot as plt

    steps = np.array([s for s, _ in loads])
    stack = np.stack([a for _, a in loads])  # [steps, layers, experts]
    relative = stack / np.maximum(stack.mean(axis=2, keepdims=True), 1e-9)
    bins = np.array_split(np.arange(len(steps)), min(HEATMAP_COLUMNS, len(steps)))
    binned = np.stack([relative[b].mean(axis=0) for b in bins])  # [columns, layers, experts]
    n_layers = binned.shape[1]
    fig, axes = plt.subplots(n_layers, 1, figsize=(9, 1.0 + 1.6 * n_layers), squeeze=False, sharex=True)
    vmax = max(2.0, float(binned.max()))
    for i, ax in enumerate(axes[:, 0]):
        im = ax.imshow(
            binned[:, i, :].T,
            aspect="auto",
            cmap="magma",
            vmin=0.0,
            vmax=vmax,
            interpolation="nearest",
            extent=(steps[0], steps[-1], binned.shape[2] - 0.5, -0.5),
        )
        ax.set_ylabel(f"{names[i] if names and i < len(names) else f'MoE {i}'}\nexpert")
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="load / mean load")
    fig.suptitle("Routed-expert load (1.0 = perfectly balanced)")
    return fig


def _smooth(values: list[float], window: int = 21) -> list[float]:
    """A centred moving average (shorter at the ends): a trailing one lags the curve and drew the
    smoothed loss visibly above the raw one."""
    half = window // 2
    cumsum = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
    idx = np.arange(len(values))
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, len(values))
    return ((cumsum[hi] - cumsum[lo]) / (hi - lo)).tolist()


def _save(fig, path: Path) -> Path:
    return save_figure(fig, path, dpi=110)
