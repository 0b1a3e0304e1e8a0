"""Turn analyzer results into sections (title, header, rows, notes), then into rich tables or Markdown.

One description serves both outputs, so the terminal and the Markdown can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv3.analysis.paper import PaperRow
from dsv3.termtable import fmt_flops, fmt_rate, fmt_seconds


@dataclass
class Section:
    title: str
    header: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def fmt_count(n: float) -> str:
    """Parameter counts: 671.03B, 37.55B, 2.73M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


__all__ = ["Section", "analyze_sections", "fmt_bytes", "fmt_count", "fmt_flops", "fmt_num", "fmt_rate", "fmt_seconds",
           "paper_sections", "print_rich", "to_markdown"]


def fmt_bytes(n: float) -> str:
    """Decimal units, as the paper's 70.272 KB."""
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {suffix}"
    return f"{n:.0f} B"


def fmt_num(x: float) -> str:
    """Six significant digits: enough to show 70.272 and 516.096 exactly, short for everything else."""
    return f"{x:,.6g}"


def _ep_cell(ep: dict[str, float] | None) -> str:
    return "-" if not ep else f"{fmt_seconds(ep['tpot_s'])} / {fmt_rate(ep['tps'])} TPS"


def _tpot_cell(ep: dict[str, float] | None) -> str:
    return "-" if not ep else fmt_seconds(ep["tpot_s"])


def analyze_sections(r: dict[str, Any]) -> list[Section]:
    m = r["model"]
    model = Section(f"Model: {m['name']}", ["field", "value"], [[k, str(v)] for k, v in m.items() if k != "name"])
    params = Section("Parameters by category", ["category", "total", "activated per token"],
                     [[c, fmt_count(v["total"]), fmt_count(v["active"])] for c, v in r["params_by_category"].items()])
    params.rows += [["TOTAL (main model)", fmt_count(r["total_params"]), fmt_count(r["active_params"])],
                    ["MTP modules (apart)", fmt_count(r["mtp_params"]), fmt_count(r["mtp_active_params"])],
                    ["activated matmul weights (N of 6N)", "", fmt_count(r["matmul_active_params"])]]
    params.notes.append(r["conventions"]["params"])
    mem = _memory_section(r)
    fl = Section(f"FLOPs per token (seq_len {r['seq_len']}, decode context {r['decode_context']})",
                 ["quantity", "value"], [
                     ["training, causal attention", fmt_flops(r["train_flops_per_token"])],
                     ["training, non-causal attention", fmt_flops(r["train_flops_per_token_noncausal"])],
                     ["training, causal, with MTP", fmt_flops(r["train_flops_per_token_with_mtp"])],
                     ["prefill (forward)", fmt_flops(r["prefill_flops_per_token"])],
                     ["decode (forward)", fmt_flops(r["decode_flops_per_token"])]],
                 [r["conventions"]["train_flops"], r["conventions"]["inference_flops"]])
    if r["decode_flops_per_token_absorbed"] is not None:
        fl.rows.append(["decode, MLA absorbed", fmt_flops(r["decode_flops_per_token_absorbed"])])
    mtp = r["mtp"]
    mtp_label = f"MTP speed-up at {mtp['acceptance']:.0%} acceptance, depth {mtp['depth']}"
    if not mtp["has_mtp"]:
        mtp_label += " (hypothetical: the model has no MTP module)"
    speed = Section("Decode-speed bounds", ["quantity", "value"], [
        ["EP bound at 50 GB/s (TPOT / TPS)", _ep_cell(r["ep_bound"])], [mtp_label, f"{mtp['speedup']:.2f}x"]],
        [r["conventions"]["ep_bound"], r["conventions"]["mtp"]])
    if "meta_check" in r:
        check = r["meta_check"]
        params.notes.append("cross-check against dsv3.model.Transformer on the meta device: " + (
            "all categories agree" if check["agrees"] else "DISAGREES: " + ", ".join(
                f"{c} {v['analytic']} vs {v['meta_model']}" for c, v in check["by_category"].items()
                if v["analytic"] != v["meta_model"])))
    return [model, params, mem, fl, speed, _hardware_section(r), _training_section(r)]


def _memory_section(r: dict[str, Any]) -> Section:
    kv = r["kv_cache"]
    rows = [["KV cache per token (bf16)", fmt_bytes(r["kv_bytes_per_token"])]]
    if r["kv_dtype"] != "bf16":
        rows.append([f"KV cache per token ({r['kv_dtype']})", fmt_bytes(r["kv_bytes_per_token_at_kv_dtype"])])
    rows.append([f"KV cache, {kv['batch']} x {kv['context']} tokens ({r['kv_dtype']})", fmt_bytes(kv["bytes"])])
    for dtype, size in r["weight_bytes"].items():
        with_mtp = r["weight_bytes_with_mtp"][dtype]
        rows.append([f"weights {dtype}" + (" (with MTP)" if r["mtp_params"] else ""),
                     fmt_bytes(size) + (f" ({fmt_bytes(with_mtp)})" if r["mtp_params"] else "")])
    return Section("Memory", ["quantity", "value"], rows, [r["conventions"]["kv_cache"], r["conventions"]["weights"]])


def _hardware_section(r: dict[str, Any]) -> Section:
    """One row per device; the EP columns give TPOT only (TPS is its inverse), so that the seven columns
    fit 80 terminal columns without breaking a number."""
    rows = [[h["hardware"], f"{h['memory_gb']:g}", f"{h['memory_bandwidth_gbs']:g}",
             "yes" if h["fits"] else f"no: {h['devices_needed']}", fmt_rate(h["tps"]),
             _tpot_cell(h["ep_bound_scale_out"]), _tpot_cell(h["ep_bound_scale_up"])] for h in r["hardware"]]
    notes = [r["conventions"]["local_decode"],
             "fits: whether the weights fit one device (else how many are needed); EP TPOT: the EP bound's time "
             "per output token over scale-out and over scale-up links (TPS = 1 / TPOT)"]
    notes += [f"{h['hardware']}: {h['source']}" for h in r["hardware"]]
    return Section(f"Hardware (weights {r['weight_dtype']}, KV {r['kv_dtype']}, context {r['decode_context']})",
                   ["hardware", "memory GB", "mem GB/s", "fits", "local decode TPS", "EP TPOT out", "EP TPOT up"],
                   rows, notes)


def _training_section(r: dict[str, Any]) -> Section:
    t = r["training_cost"]
    rows = [["tokens", fmt_count(t["tokens"])], ["FLOPs per token", fmt_flops(t["flops_per_token"])],
            ["hardware / peak BF16", f"{t['hardware']} / {t['peak_tflops']:g} TFLOPS"], ["MFU", f"{t['mfu']:.2%}"],
            ["GPU-hours", fmt_count(t["gpu_hours"])], [f"cost at ${t['usd_per_gpu_hour']:g}/GPU-hour",
                                                       f"${fmt_count(t['usd'])}"]]
    rows += [[f"days on {g} GPUs", f"{d:.1f}"] for g, d in t["days_on"].items()]
    return Section("Training cost", ["quantity", "value"], rows)


def paper_sections(rows: list[PaperRow]) -> list[Section]:
    groups: dict[str, Section] = {}
    for row in rows:
        section = groups.setdefault(row.group, Section(row.group, ["quantity", "paper", "ours", "unit", "diff",
                                                                   "note"], []))
        section.rows.append([row.quantity, fmt_num(row.paper), fmt_num(row.ours), row.unit,
                             f"{row.diff_pct:+.2f}%", row.note])
    return list(groups.values())


def to_markdown(sections: list[Section], title: str = "") -> str:
    out = [f"# {title}", ""] if title else []
    for s in sections:
        out += [f"## {s.title}", "", "| " + " | ".join(s.header) + " |", "|" + "---|" * len(s.header)]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in s.rows]
        if s.notes:
            out += [""] + [f"- {n}" for n in s.notes]
        out.append("")
    return "\n".join(out)


def print_rich(sections: list[Section]) -> None:
    """Rich tables sized to the terminal (no number or name split across lines); each title is its
    own line rather than wrapped to the table's width, and the paper's long notes go below their
    table, labelled by row, instead of into a column a few characters wide."""
    from rich.console import Console

    from dsv3.termtable import fitted_table

    console = Console()
    for s in sections:
        note_col = s.header.index("note") if "note" in s.header else None
        header = [h for i, h in enumerate(s.header) if i != note_col]
        rows = [[c for i, c in enumerate(row) if i != note_col] for row in s.rows]
        row_notes = [f"{row[0]}: {row[note_col]}" for row in s.rows if note_col is not None and row[note_col]]
        console.print(s.title, style="bold", highlight=False)
        console.print(fitted_table(header, rows, console.width))
        for note in row_notes + s.notes:
            console.print(f"  [dim]{note}[/dim]", highlight=False)
        console.print()
