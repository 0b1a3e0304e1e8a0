"""`dsv3 plan train|serve`: the cluster planner's front end (rich tables, --json, PNG charts)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from dsv3.analysis.arch import load_architecture
from dsv3.analysis.hardware import resolve_hardware
from dsv3.analysis.plan import (
    GB,
    TABLE4,
    V3_PRETRAIN_GPU_HOURS,
    V3_PRETRAIN_TOKENS,
    Assumptions,
    Cluster,
    Knobs,
    Precision,
    TrainPlan,
    capacity_bytes,
    check_cluster,
    gpu_hours,
    is_paper_setup,
    label,
    plan_train,
    planned_layout,
    search,
    sensitivity,
    table4_errors,
)
from dsv3.analysis.plan_serve import ServeOptions, plan_serve
from dsv3.errors import DSV3Error

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Plan a training or serving layout: memory per GPU, step time, throughput, what-ifs.")

ConfigOpt = Annotated[str, typer.Option("--config", help="A preset (deepseek-v3, ...) or a HF config.json.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", help="Hardware preset (h800, h100, ...) or YAML/JSON file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot-dir", help="Write PNG charts into this folder.")]
NvlOpt = Annotated[float | None, typer.Option("--nvlink-GBps", help="Scale-up GB/s per GPU per direction.")]
NicOpt = Annotated[float | None, typer.Option("--nic-gbps", help="Scale-out NIC Gb/s per GPU per direction.")]
DomainOpt = Annotated[int | None, typer.Option("--scale-up-domain", help="GPUs per NVLink domain (72: NVL72).")]
MulticastOpt = Annotated[bool, typer.Option("--multicast", help="In-network multicast for the dispatch.")]
ReduceOpt = Annotated[bool, typer.Option("--in-network-reduce", help="In-network reduction for the combine.")]
CombineOpt = Annotated[str, typer.Option("--combine", help="Combine format on the wire: bf16, fp8, logfmt10.")]
OffloadOpt = Annotated[bool, typer.Option("--sm-offload", help="Communication offloaded: no SMs lost to it.")]


def _knobs(nvlink, nic, domain, multicast, reduce, combine, offload) -> Knobs:
    knobs = Knobs(nvlink_gbs=nvlink, nic_gbps=nic, scale_up_domain=domain, multicast=multicast,
                  in_network_reduce=reduce, combine_format=combine, sm_offload=offload)
    knobs.check()
    return knobs


def _hardware(name: str):
    devices = resolve_hardware([name])
    if len(devices) != 1:
        raise DSV3Error(f"{name} holds {len(devices)} devices; give a file with one")
    return devices[0]


def _emit(payload: dict, as_json: bool, render) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, default=float) + "\n")
    else:
        render()


def _console():
    from rich.console import Console

    return Console()


def _table(title: str, columns: list[str], rows: list[list[Any]]):
    from rich.table import Table

    _console().print(f"[bold]{title}[/]")
    table = Table()
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        table.add_row(*[str(x) for x in r])
    return table


def _assumptions_payload(a: Assumptions) -> dict[str, Any]:
    values = asdict(a)
    return {"values": values, "fitted_to_table4": list(Assumptions.FITTED),
            "note": "the fitted values were fitted once to ISCA Table 4 (V3 on 2,048 H800s) and are held fixed for "
                    "every other layout, hardware and what-if"}


# ---- train ------------------------------------------------------------------------------------------

def _plan_rows(plan: TrainPlan) -> list[list[Any]]:
    b = plan.breakdown
    return [[k, f"{b[k]:.2f}"] for k in ("1F", "1B", "1W", "1F1B", "bubble", "opt")] + [
        ["step", f"{plan.step_s:.2f}"]]


def _memory_rows(plan: TrainPlan) -> list[list[Any]]:
    return [[k, f"{v / GB:.1f}"] for k, v in plan.memory.items()]


def _print_train_flags(plan: TrainPlan) -> None:
    """The `dsv3 train` flags of a plan (under torchrun on as many processes as GPUs), then its note."""
    con = _console()
    if plan.train_args is not None:
        con.print(f"dsv3 train flags: {' '.join(plan.train_args)}", markup=False, highlight=False, soft_wrap=True)
    if plan.train_args_note:
        con.print(f"note: {plan.train_args_note}", markup=False, highlight=False)


def _render_plan(plan: TrainPlan, extra: dict[str, Any]) -> None:
    con = _console()
    con.print(f"[bold]{label(plan.layout)}[/]  DP{plan.dp}, {plan.micro_batches} micro-batches per pipeline")
    _print_train_flags(plan)
    con.print(_table("step time (s), Table 4's terms", ["part", "seconds"], _plan_rows(plan)))
    con.print(_table("memory per GPU (GB, busiest rank)", ["what", "GB"], _memory_rows(plan)))
    con.print(f"fits: {'yes' if plan.fits else 'NO'}; tokens/day {plan.tokens_per_day / 1e9:.1f} B; "
              f"causal MFU {plan.mfu_causal:.1%}")
    if "paper" in extra:
        rows = [[k.replace("_s", " (s)").replace("tokens_per_day", "tokens/day (B)"),
                 f"{TABLE4[k] / (1e9 if k == 'tokens_per_day' else 1):g}", f"{v:+.1%}"]
                for k, v in extra["paper"]["relative_error"].items()]
        con.print(_table("against ISCA Table 4", ["quantity", "paper", "planner"], rows))
        gh = extra["paper"]["gpu_hours_14_8T"]
        con.print(f"GPU-hours for 14.8T tokens: {gh / 1e6:.3f} M "
                  f"(paper 2.664 M, {gh / V3_PRETRAIN_GPU_HOURS - 1:+.1%})")
    if "sensitivity" in extra:
        rows = [[r["input"], r["change"], f"{r['tokens_per_day_change']:+.2%}"] for r in extra["sensitivity"]]
        con.print(_table("sensitivity of tokens/day", ["input", "change", "tokens/day"], rows))


def _render_search(result: dict[str, Any]) -> None:
    con = _console()
    rows = [[label(p.layout), p.dp, f"{p.memory['total'] / GB:.1f}", f"{p.step_s:.2f}",
             f"{p.tokens_per_day / 1e9:.1f}"] for p in result["ranked"]]
    con.print(_table(f"layouts that fit, best first ({result['fit']} of {result['considered']} fit)",
                     ["layout", "DP", "GB/GPU", "step s", "B tok/day"], rows))
    m = {k: v / GB for k, v in result["ranked"][0].memory.items()}
    con.print(f"memory budget of the best (GB per GPU): weights {m['weights']:.1f} + gradients {m['gradients']:.1f}"
              f" + optimizer {m['optimizer']:.1f} + activations {m['activations']:.1f} + reserve {m['reserve']:.1f}"
              f" = {m['total']:.1f}")
    tp = result["best_with_tp"]
    if tp is not None:
        con.print(f"best with TP: {label(tp.layout)} at {tp.tokens_per_day / 1e9:.1f} B tokens/day")
    con.print(result["why_not_tp"])
    runs = result["best_for_trainer"]
    if runs is not None:
        con.print(f"best that dsv3 train runs: {label(runs.layout)} at {runs.tokens_per_day / 1e9:.1f} B tokens/day")
        _print_train_flags(runs)


def _why_not_tp(result: dict[str, Any]) -> str:
    best, tp = result["ranked"][0], result["best_with_tp"]
    if best.layout.tp > 1:
        return (f"TP is chosen: TP{best.layout.tp} cuts the weights and activations each GPU holds, and here that "
                "buys more than its all-reduces cost")
    if tp is None:
        return "why no TP: no layout with TP fits, or TP does not divide the GPU count"
    return (f"why no TP: TP splits every GEMM and adds two all-reduces per layer and direction over NVLink; the "
            f"best TP layout reaches {tp.tokens_per_day / best.tokens_per_day:.0%} of the best layout's tokens/day, "
            "and MoE with EP already cuts per-GPU weights without it")


def _search_payload(result: dict[str, Any]) -> dict[str, Any]:
    return {"ranked": [p.as_dict() for p in result["ranked"]], "considered": result["considered"],
            "fit": result["fit"], "did_not_fit": result["did_not_fit"],
            "best_with_tp": result["best_with_tp"].as_dict() if result["best_with_tp"] else None,
            "best_for_trainer": result["best_for_trainer"].as_dict() if result["best_for_trainer"] else None,
            "why_not_tp": result["why_not_tp"]}


@app.command("train")
def train_command(
    config: ConfigOpt = "deepseek-v3", hardware: HardwareOpt = "h800",
    gpus: Annotated[int, typer.Option(help="GPUs in the job.")] = 2048,
    topology: Annotated[str, typer.Option(help="ft2 | ft3 | mpft | mrft | sf | df")] = "mpft",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 4096,
    global_batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 15360,
    pp: Annotated[int | None, typer.Option(help="Pipeline stages (with --ep: plan this layout; "
                                                "without: search).")] = None,
    ep: Annotated[int | None, typer.Option(help="Expert-parallel degree (divides DP).")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
    dp_shard: Annotated[str, typer.Option(help="zero1, fsdp or none.")] = "zero1",
    pp_schedule: Annotated[str, typer.Option(help="Pipeline schedule: dualpipe, dualpipev or 1f1b.")] = "dualpipe",
    compute: Annotated[str, typer.Option(help="GEMM precision: fp8 or bf16.")] = "fp8",
    master: Annotated[str, typer.Option(help="Master weights: fp32, bf16 or none.")] = "fp32",
    grads: Annotated[str, typer.Option(help="Gradient accumulation dtype: fp32, bf16.")] = "fp32",
    moments: Annotated[str, typer.Option(help="AdamW moments: bf16 or fp32.")] = "bf16",
    nvlink_gbs: NvlOpt = None, nic_gbps: NicOpt = None, scale_up_domain: DomainOpt = None,
    multicast: MulticastOpt = False, in_network_reduce: ReduceOpt = False, combine: CombineOpt = "bf16",
    sm_offload: OffloadOpt = False, as_json: JsonOpt = False, plot_dir: PlotOpt = None,
) -> None:
    """Per-GPU memory and the step time in Table 4's terms; without --pp/--ep, rank the layouts that fit."""
    arch = load_architecture(config)
    knobs = _knobs(nvlink_gbs, nic_gbps, scale_up_domain, multicast, in_network_reduce, combine, sm_offload)
    cluster = Cluster(_hardware(hardware), gpus, topology, knobs)
    check_cluster(cluster)
    prec = Precision(compute=compute, master=master, grads=grads, moments=moments)
    a = Assumptions()
    if (pp is None) != (ep is None):
        raise DSV3Error("give both --pp and --ep to plan one layout, or neither to search")
    if pp is None:
        result = search(arch, cluster, seq_len, global_batch, prec, a)
        result["why_not_tp"] = _why_not_tp(result)
        payload = {"mode": "search", **_search_payload(result), "assumptions": _assumptions_payload(a)}
        if plot_dir is not None:
            from dsv3.analysis.plan_plots import plot_memory

            capacity = capacity_bytes(cluster.hardware) / GB
            payload["plots"] = [str(plot_memory(result["ranked"], plot_dir / "plan_memory.png", capacity))]
        _emit(payload, as_json, lambda: _render_search(result))
        return
    layout = planned_layout(gpus, pp=pp, ep=ep, dp_shard=dp_shard, schedule=pp_schedule, tp=tp)
    plan = plan_train(arch, cluster, layout, seq_len, global_batch, prec, a)
    if not plan.fits:
        raise DSV3Error(f"{arch.name} does not fit: {label(layout)} needs {plan.memory['total'] / GB:.1f} GB per "
                        f"GPU (weights {plan.memory['weights'] / GB:.1f}, gradients {plan.memory['gradients'] / GB:.1f}"
                        f", optimizer {plan.memory['optimizer'] / GB:.1f}, activations "
                        f"{plan.memory['activations'] / GB:.1f}) and {hardware} has {cluster.hardware.memory_gb:g} GB")
    extra: dict[str, Any] = {"sensitivity": sensitivity(arch, cluster, layout, seq_len, global_batch, prec, a)}
    if is_paper_setup(arch, cluster, layout, seq_len, global_batch) and prec == Precision():
        extra["paper"] = {"relative_error": table4_errors(plan), "gpu_hours_14_8T": gpu_hours(plan, gpus),
                          "tokens": V3_PRETRAIN_TOKENS}
    payload = {"mode": "plan", **plan.as_dict(), "gpu_hours_per_trillion_tokens": gpu_hours(plan, gpus, 1e12),
               "assumptions": _assumptions_payload(a), "precision": asdict(prec), "knobs": asdict(knobs), **extra}
    if plot_dir is not None:
        from dsv3.analysis.plan_plots import plot_breakdown, plot_knob

        payload["plots"] = [
            str(plot_breakdown(plan, plot_dir / "plan_step.png")),
            str(plot_knob(arch, cluster, layout, seq_len, global_batch, prec, a, plot_dir / "plan_nic.png")),
        ]
    _emit(payload, as_json, lambda: _render_plan(plan, extra))


# ---- serve ------------------------------------------------------------------------------------------

def _render_serve(result: dict[str, Any]) -> None:
    con = _console()
    pre, dec = result["prefill"], result["decode"]
    rows = [
        ["GPUs (EP)", pre["gpus"], dec["gpus"]],
        ["step (ms)", f"{pre['step_ms']:.1f}", f"{dec['step_ms']:.1f}"],
        ["tokens/s per GPU", f"{pre['tokens_per_s_per_gpu']:,.0f}", f"{dec['tokens_per_s_per_gpu']:,.0f}"],
        ["tokens/s per node", f"{pre['tokens_per_s_per_node']:,.0f}", f"{dec['tokens_per_s_per_node']:,.0f}"],
    ]
    con.print(_table("prefill and decode", ["", "prefill", "decode"], rows))
    con.print(f"decode: TPOT {dec['tpot_ms']:.1f} ms ({dec['user_tokens_per_s']:.1f} tokens/s per user, MTP "
              f"{dec['mtp_tokens_per_step']:.2f} tokens/step); EP communication bound "
              f"{dec['ep_comm_bound_tpot_ms']:.1f} ms; KV cache {dec['kv_cache_gb']:.1f} GB per GPU")
    if "published" in result:
        p = result["published"]
        con.print(f"published per H800 node: prefill 73.7k (planner x{p['prefill_ratio']:.2f}), decode 14.8k "
                  f"(planner x{p['decode_ratio']:.2f})")


@app.command("serve")
def serve_command(
    config: ConfigOpt = "deepseek-v3", hardware: HardwareOpt = "h800",
    prefill_gpus: Annotated[int, typer.Option(help="GPUs of one prefill unit (its EP degree).")] = 32,
    decode_gpus: Annotated[int, typer.Option(help="GPUs of one decode unit (its EP degree).")] = 144,
    context: Annotated[int, typer.Option(help="Average KV length per sequence.")] = 4989,
    batch_per_gpu: Annotated[int, typer.Option(help="Decode sequences per GPU per step.")] = 128,
    prefill_tokens: Annotated[int, typer.Option(help="Prompt tokens per prefill GPU per step.")] = 16384,
    redundant_experts: Annotated[int, typer.Option(help="Extra expert replicas for load balance.")] = 32,
    mtp_acceptance: Annotated[float, typer.Option(help="MTP second-token acceptance (0: no MTP).")] = 0.85,
    cache_hit: Annotated[float, typer.Option(help="Share of prompt tokens served from a prefix cache.")] = 0.0,
    nvlink_gbs: NvlOpt = None, nic_gbps: NicOpt = None, scale_up_domain: DomainOpt = None,
    multicast: MulticastOpt = False, in_network_reduce: ReduceOpt = False, combine: CombineOpt = "bf16",
    sm_offload: OffloadOpt = False, as_json: JsonOpt = False, plot_dir: PlotOpt = None,
) -> None:
    """Prefill and decode throughput per node and TPOT, with the EP communication bound beside them."""
    arch = load_architecture(config)
    knobs = _knobs(nvlink_gbs, nic_gbps, scale_up_domain, multicast, in_network_reduce, combine, sm_offload)
    cluster = Cluster(_hardware(hardware), prefill_gpus + decode_gpus, "mpft", knobs)
    opts = ServeOptions(context=context, decode_batch=batch_per_gpu, prefill_tokens=prefill_tokens,
                        redundant_experts=redundant_experts, mtp_acceptance=mtp_acceptance, cache_hit=cache_hit)
    a = Assumptions()
    result = plan_serve(arch, cluster, prefill_gpus, decode_gpus, opts, a)
    payload = {**result, "options": asdict(opts), "knobs": asdict(knobs), "assumptions": _assumptions_payload(a)}
    if plot_dir is not None:
        from dsv3.analysis.plan_plots import plot_serve

        published = result["published"]["decode_tokens_per_s_per_node"] if "published" in result else None
        payload["plots"] = [str(plot_serve(arch, cluster, decode_gpus, opts, a, plot_dir / "plan_serve_decode.png",
                                           published))]
    _emit(payload, as_json, lambda: _render_serve(result))
