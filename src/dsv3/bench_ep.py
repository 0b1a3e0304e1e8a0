"""`dsv3 bench ep`: one expert-parallel MoE layer on N x G local gloo processes, forward + backward,
checked against the same layer in one process, with the traffic it sent and the analytic traffic.

``--tokens`` is per rank. Times are wall-clock on this machine (CPU processes sharing its cores, gloo over
loopback): they show where time goes here, not what NVLink/InfiniBand would do.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from dsv3.errors import DSV3Error
from dsv3.parallel import eplb
from dsv3.parallel.placement import Placement
from dsv3.parallel.wire import COMBINE_FORMATS, DISPATCH_FORMATS
from dsv3.testing.ep_scenarios import LayerSpec, global_load, layer_worker, rank_assignments
from dsv3.testing.launch import launch

EPLB_POLICIES = ("none", "hierarchical", "global")
MAX_PROCESSES = 64


def main(
    nodes: Annotated[int, typer.Option(help="Nodes (one expert group per node).")] = 2,
    gpus_per_node: Annotated[int, typer.Option(help="EP ranks per node.")] = 2,
    experts: Annotated[int, typer.Option(help="Routed experts.")] = 16,
    topk: Annotated[int, typer.Option(help="Experts per token.")] = 4,
    topk_groups: Annotated[int, typer.Option("--node-limit",
                                             help="Node limit M: groups (= nodes) a token may use.")] = 2,
    tokens: Annotated[int, typer.Option(help="Tokens per rank.")] = 64,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 256,
    inter: Annotated[int, typer.Option(help="Expert intermediate size (default hidden / 4).")] = 0,
    dispatch: Annotated[str, typer.Option(help="Dispatch wire format: fp8 | bf16 | fp32.")] = "fp8",
    combine: Annotated[
        str, typer.Option(help="Combine wire format: bf16 | logfmt8 | logfmt10 | fp32.")
    ] = "bf16",
    dtype: Annotated[
        str, typer.Option(help="Activations and expert weights: bfloat16 | float32.")
    ] = "bfloat16",
    overlap_repeats: Annotated[
        int, typer.Option(help="Repeats of the dual micro-batch timing (0: skip).")
    ] = 3,
    eplb_policy: Annotated[str, typer.Option("--eplb", help="none | hierarchical | global.")] = "none",
    redundant: Annotated[int, typer.Option("--redundant-experts",
                                           help="Redundant expert slots in total (with --eplb).")] = 0,
    skew: Annotated[float, typer.Option(help="Make some experts hot (Zipf-like selection bias).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds before a hung run is aborted.")] = 300.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")
    ] = False,
) -> None:
    """Run one EP MoE layer forward + backward on N x G gloo processes and report accuracy and traffic."""
    _check(nodes, gpus_per_node, dispatch, combine, dtype, eplb_policy, redundant, tokens, hidden)
    spec = LayerSpec(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        experts=experts,
        topk=topk,
        topk_groups=topk_groups,
        tokens=tokens,
        hidden=hidden,
        inter=inter or max(hidden // 4, 1),
        dispatch=dispatch,
        combine=combine,
        dtype=dtype,
        seed=seed,
        skew=skew,
        overlap_repeats=overlap_repeats,
    )
    spec.config()  # validates the routing setup before any process starts
    balance = None
    if eplb_policy != "none":
        spec, balance = _with_eplb(spec, eplb_policy, redundant)
    print(f"running {spec.world} processes ...", file=sys.stderr)
    raw = launch(layer_worker, spec.world, (spec,), timeout_s=timeout)[0]
    report = _report(raw, balance)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        _print_table(report)


def _check(nodes, gpus, dispatch, combine, dtype, policy, redundant, tokens, hidden) -> None:
    if nodes < 1 or gpus < 1 or nodes * gpus > MAX_PROCESSES:
        raise DSV3Error(
            f"--nodes x --gpus-per-node must be 1..{MAX_PROCESSES} processes, got {nodes} x {gpus}"
        )
    if dispatch not in DISPATCH_FORMATS:
        raise DSV3Error(f"--dispatch must be one of {', '.join(DISPATCH_FORMATS)}, got {dispatch!r}")
    if combine not in COMBINE_FORMATS:
        raise DSV3Error(f"--combine must be one of {', '.join(COMBINE_FORMATS)}, got {combine!r}")
    if dtype not in ("bfloat16", "float32"):
        raise DSV3Error(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    if policy not in EPLB_POLICIES:
        raise DSV3Error(f"--eplb must be one of {', '.join(EPLB_POLICIES)}, got {policy!r}")
    if redundant < 0 or (redundant and policy == "none"):
        raise DSV3Error("--redundant-experts needs --eplb and must be >= 0")
    if tokens < 1 or hidden < 1:
        raise DSV3Error("--tokens and --hidden must be positive")
    if combine.startswith("logfmt") and hidden % 8:
        raise DSV3Error(f"LogFMT packs whole bytes per token: --hidden must be a multiple of 8, got {hidden}")


def _with_eplb(spec: LayerSpec, policy: str, redundant: int) -> tuple[LayerSpec, dict]:
    """Plan a placement from the routing's global per-expert load; loads per GPU before and after."""
    world = spec.world
    slots = spec.experts + redundant
    if slots % world:
        raise DSV3Error(f"experts + redundant ({slots}) must divide evenly over {world} ranks")
    load = global_load(spec)
    if policy == "hierarchical":
        phy2log = eplb.hierarchical_policy(load, slots, spec.nodes, spec.nodes, world)
    else:
        phy2log = eplb.global_policy(load, slots, world)
    before = rank_assignments(spec, Placement.contiguous(spec.experts, world)).double()
    balance = {
        "policy": policy,
        "redundant_slots": redundant,
        "gpu_load_max_over_mean_before": float(before.max() / before.mean()),
        "predicted_max_over_mean_after": eplb.imbalance(phy2log, load, world),
        "rebalance": _rebalance_tradeoff(spec, policy, phy2log, slots),
    }
    return replace(spec, phy2log=tuple(phy2log.tolist())), balance


def _rebalance_tradeoff(spec: LayerSpec, policy: str, current: torch.Tensor, slots: int) -> dict:
    """The load shifts (the next seed's hot experts): experts moved vs balance, incremental vs re-plan."""
    world = spec.world
    new_load = global_load(replace(spec, seed=spec.seed + 1))
    per_node = spec.gpus_per_node if policy == "hierarchical" else None
    if policy == "hierarchical":
        replan = eplb.hierarchical_policy(new_load, slots, spec.nodes, spec.nodes, world)
    else:
        replan = eplb.global_policy(new_load, slots, world)
    steps = []
    for budget in (0, 1, 2, 4, 8, 16, 32):
        r = eplb.rebalance(current, new_load, world, budget, gpus_per_node=per_node)
        steps.append({"max_moves": budget, "moves": r.moves, "max_over_mean": r.imbalance})
    return {
        "incremental": steps,
        "replan": {
            "moves": eplb.moved_experts(current, replan, world),
            "max_over_mean": eplb.imbalance(replan, new_load, world),
        },
    }


def _report(raw: dict, balance: dict | None) -> dict:
    spec, times = raw["spec"], raw["times"]
    report = {
        "nodes": spec["nodes"],
        "gpus_per_node": spec["gpus_per_node"],
        "experts": spec["experts"],
        "topk": spec["topk"],
        "topk_groups": spec["topk_groups"],
        "tokens_per_rank": spec["tokens"],
        "hidden": spec["hidden"],
        "dispatch": spec["dispatch"],
        "combine": spec["combine"],
        "dtype": spec["dtype"],
    }
    keys = (
        "max_abs_diff_vs_single",
        "max_abs_single",
        "output_rel_error",
        "grad_rel_error",
        "grad_max_abs_diff",
        "grad_max_abs",
        "aux_loss_diff",
        "expert_load_equal",
        "mean_inter_node_copies_per_token",
        "max_inter_node_copies_per_token",
        "mean_nodes_per_token",
        "max_nodes_per_token",
        "mean_inter_node_copies_without_dedup",
        "max_inter_node_copies_without_dedup",
        "mean_intra_node_copies_per_token",
        "node_limit",
        "inter_node_bytes",
        "intra_node_bytes",
        "inter_node_metadata_bytes",
        "intra_node_metadata_bytes",
        "bytes_per_token_row",
        "traffic_matches_analytic",
        "traffic_measured",
        "traffic_analytic",
    )
    report.update({k: raw[k] for k in keys})
    report["without_node_limit"] = raw["without_node_limit"]
    report.update(
        {
            "dispatch_s": times["dispatch"]["max_s"],
            "compute_s": times["experts"]["max_s"],
            "combine_s": times["combine"]["max_s"],
            "backward_s": times["backward"]["max_s"],
            "times_mean_over_ranks": {k: v["mean_s"] for k, v in times.items()},
        }
    )
    if "overlap" in raw:
        report["overlap"] = raw["overlap"]
    assigned = torch.tensor(raw["assignments_per_rank"], dtype=torch.float64)
    report["assignments_per_rank"] = raw["assignments_per_rank"]
    report["gpu_load_max_over_mean"] = float(assigned.max() / assigned.mean()) if assigned.sum() else 1.0
    if balance is not None:
        report["eplb"] = {**balance, "gpu_load_max_over_mean_after": report["gpu_load_max_over_mean"]}
    return report


def _print_table(report: dict) -> None:
    table = Table(
        title=f"EP layer: {report['nodes']} nodes x {report['gpus_per_node']} GPUs, "
        f"top-{report['topk']} of {report['experts']}, M = {report['topk_groups']}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        (
            "max |EP - single| (output)",
            f"{report['max_abs_diff_vs_single']:.3g} of {report['max_abs_single']:.3g}",
        ),
        (
            "inter-node copies / token (mean, max)",
            f"{report['mean_inter_node_copies_per_token']:.2f}, {report['max_inter_node_copies_per_token']}",
        ),
        (
            "  without dedup (mean, max)",
            f"{report['mean_inter_node_copies_without_dedup']:.2f}, "
            f"{report['max_inter_node_copies_without_dedup']}",
        ),
        (
            "  without node limit, dedup (mean, max)",
            f"{report['without_node_limit']['mean_inter_node_copies_per_token']:.2f}, "
            f"{report['without_node_limit']['max_inter_node_copies_per_token']}",
        ),
        ("inter-node bytes (fwd dispatch+combine)", f"{report['inter_node_bytes']:,}"),
        ("intra-node bytes (fwd dispatch+combine)", f"{report['intra_node_bytes']:,}"),
        ("traffic equals analytic", str(report["traffic_matches_analytic"])),
        (
            "dispatch / compute / combine / backward s",
            f"{report['dispatch_s']:.4f} / {report['compute_s']:.4f} / "
            f"{report['combine_s']:.4f} / {report['backward_s']:.4f}",
        ),
        ("GPU load max/mean", f"{report['gpu_load_max_over_mean']:.3f}"),
    ]
    if "overlap" in report:
        o = report["overlap"]
        rows.append(
            (
                "dual micro-batch: seq / overlapped s, hidden",
                f"{o['sequential_s']:.4f} / {o['overlapped_s']:.4f}, {100 * o['hidden_fraction']:.0f}%",
            )
        )
    if "eplb" in report:
        e = report["eplb"]
        rows.append(
            (
                f"EPLB {e['policy']}: load max/mean before -> after",
                f"{e['gpu_load_max_over_mean_before']:.3f} -> {e['gpu_load_max_over_mean_after']:.3f}",
            )
        )
        for step in e["rebalance"]["incremental"]:
            rows.append(
                (
                    f"  load shift, rebalance <= {step['max_moves']} moves",
                    f"{step['moves']} moved, max/mean {step['max_over_mean']:.3f}",
                )
            )
        replan = e["rebalance"]["replan"]
        rows.append(
            (
                "  load shift, re-plan from scratch",
                f"{replan['moves']} moved, max/mean {replan['max_over_mean']:.3f}",
            )
        )
    for row in rows:
        table.add_row(*row)
    Console().print(table)
