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


def test_labels_of_nearly_coinciding_models_go_to_opposite_sides():
    from dsv3.analysis.plots import _label_offset

    points = [(235.7, 21.4, "deepseek-v2"), (235.1, 22.1, "qwen3-235b-a22b"), (671.0, 37.5, "deepseek-v3")]
    upper, lower = _label_offset(points[1], points), _label_offset(points[0], points)
    assert upper[1] > 0 > lower[1]
    assert _label_offset(points[2], points)[1] > 0


def test_sweep_series_with_equal_bandwidth_stay_visible(tmp_path, monkeypatch):
    from dsv3.network import report

    figs = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path, **kw: figs.append(fig))
    rows = [{"topology": t, "routing": "adaptive", "gpus": g, "message_bytes": m, "algbw_GBps": 57.1}
            for t in ("ft3", "mpft", "mrft") for g in (16, 64) for m in (2**27, 2**32)]
    report.plot_sweep(rows, "alltoall", tmp_path)
    for fig in figs:
        widths = [line.get_linewidth() for line in fig.axes[0].lines]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3  # each drawn thinner on top
        assert fig.axes[0].get_ylim()[0] == 0
        plt.close(fig)
