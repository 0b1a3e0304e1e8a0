"""Readability of the figures that can be asserted: the train loss is drawn above the MTP loss (it was
hidden under it), the accumulation plot's K ticks are far enough apart not to collide, and the network
utilisation figure's title sits above its panels' titles."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def test_train_loss_is_drawn_over_the_mtp_loss_and_looks_different():
    from dsv3.train.plots import _loss_figure

    rng = np.random.default_rng(0)
    train = [{"step": s, "loss": 6 - s / 50 + rng.normal(0, 0.1), "mtp_loss": 6.05 - s / 50 + rng.normal(0, 0.1)}
             for s in range(1, 151)]
    fig = _loss_figure(train, [{"step": 150, "val_loss": 3.1, "val_bpb": 1.2}])
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    mtp = next(v for k, v in lines.items() if k.startswith("MTP"))
    for name in ("train (next token)", "train, smoothed"):
        assert lines[name].get_zorder() > mtp.get_zorder()
        assert lines[name].get_color() != mtp.get_color()
    assert mtp.get_linestyle() == "--" and lines["train, smoothed"].get_linewidth() > mtp.get_linewidth()
    plt.close(fig)


def test_accumulation_k_ticks_do_not_collide():
    from dsv3.studies.accumulation import _k_axis

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = [256, 320, 384, 448, 512, 4096]
    ax.plot(ks, np.linspace(1e-4, 1e-3, len(ks)))
    _k_axis(ax, ks)
    fig.canvas.draw()
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    assert len(boxes) >= 3 and all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    assert [t.get_text() for t in ax.get_xticklabels()][-1] == "4K"
    plt.close(fig)


def test_network_utilization_title_clears_the_panel_titles(tmp_path, monkeypatch):
    from dsv3.network import report

    captured = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path, **kw: captured.setdefault("fig", fig))
    util = {"nvlink": np.full(256, 0.3), "nic_up": np.full(128, 1.0), "nic_down": np.full(128, 1.0)}
    report.plot_utilization(util, "MPFT 128 GPUs, alltoall, adaptive", tmp_path / "u.png")
    fig = captured["fig"]
    fig.canvas.draw()
    title = fig._suptitle.get_window_extent()
    assert all(title.y0 > ax.title.get_window_extent().y1 for ax in fig.axes)
    plt.close(fig)
