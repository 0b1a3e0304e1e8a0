"""`dsv3 net`: topologies and their counts, Table 3's cost model, and the flow-level simulator."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import typer

from dsv3.errors import DSV3Error
from dsv3.network.catalog import KINDS, TopologySpec, build_topology, describe
from dsv3.network.cost import PRESETS, price_table, resolve_prices
from dsv3.network.fabric import LinkSpeeds
from dsv3.network.moe import EPSpec
from dsv3.network.report import format_notes, format_table, human_bytes, parse_bytes, plot_sweep, plot_utilization
from dsv3.network.simulate import TRAFFICS, SimConfig, run_simulation, sweep
from dsv3.termtable import fmt_bytes, fmt_seconds

app = typer.Typer(help="Network topologies, their cost, and a flow-level simulator.", no_args_is_help=True,
                  add_completion=False)


def _emit(payload: dict, as_json: bool, text: str) -> None:
    print(json.dumps(payload, default=_json_default) if as_json else text)


def _json_default(o):
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _spec(topology, radix, planes, rails, q, p, a, h, g, gpus, gpus_per_node) -> TopologySpec:
    if topology not in KINDS:
        raise DSV3Error(f"--topology must be one of {', '.join(KINDS)}, got {topology!r}")
    return TopologySpec(kind=topology, k=radix, planes=planes, rails=rails, q=q, p=p, a=a, h=h, g=g,
                        endpoints=gpus, gpus_per_node=gpus_per_node)


@contextmanager
def _progress(enabled: bool):
    """A rich progress bar on stderr (only when stderr is a terminal), fed (stage, fraction) updates."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, fraction: float) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=1.0)
            bar.update(tasks[stage], completed=fraction)

        yield update


@app.command()
def topology(
    topology: str = typer.Option("mpft", "--topology", help="ft2 | ft3 | mpft | mrft | sf | df"),
    radix: int = typer.Option(64, "--radix", "-k", help="switch radix (fat trees)"),
    planes: int = typer.Option(8, help="MPFT planes"),
    rails: int = typer.Option(8, help="MRFT rails"),
    q: int = typer.Option(5, help="Slim Fly q (a prime power)"),
    p: int = typer.Option(4, help="Dragonfly endpoints per router"),
    a: int = typer.Option(8, help="Dragonfly routers per group"),
    h: int = typer.Option(4, help="Dragonfly global ports per router"),
    g: int = typer.Option(None, help="Dragonfly groups (default a*h + 1)"),
    gpus: int = typer.Option(None, "--gpus", "--endpoints", help="populate only this many endpoints"),
    gpus_per_node: int = typer.Option(8, help="GPUs (and NICs) per node"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    markdown: bool = typer.Option(False, "--markdown", help="print a Markdown table"),
) -> None:
    """Build a topology graph and count endpoints, switches and links by formula and by graph."""
    topo = build_topology(_spec(topology, radix, planes, rails, q, p, a, h, g, gpus, gpus_per_node))
    d = describe(topo)
    rows = [[key, d[key]["formula"], d[key]["graph"]] for key in ("endpoints", "switches", "links")]
    rows += [["diameter (switch hops)", d["diameter_switch_hops"]["formula"], d["diameter_switch_hops"]["graph"]],
             ["bisection links", d["bisection_links"]["formula"], d["bisection_links"]["graph"]]]
    text = f"{topology.upper()} {d['params']}\n" + format_table(["metric", "formula", "graph"], rows, markdown)
    text += "\n" + format_notes(d["notes"], 10**6 if markdown else None)
    _emit(d, as_json, text)


@app.command()
def cost(
    preset: str = typer.Option("table3", help=f"price preset: {', '.join(PRESETS)}"),
    switch_price: float = typer.Option(None, help="dollars per switch (with its optics)"),
    link_price: float = typer.Option(None, help="dollars per switch-to-switch link (long, optical)"),
    local_link_price: float = typer.Option(None, help="dollars per short intra-group link (Dragonfly)"),
    endpoint_price: float = typer.Option(None, help="dollars per endpoint cable (not in Table 3)"),
    radix: int = typer.Option(64, "--radix", "-k", help="switch radix for the fat-tree rows"),
    planes: int = typer.Option(8, help="MPFT planes"),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
) -> None:
    """Table 3: counts, cost and cost per endpoint for FT2, MPFT, FT3, SF, DF, beside the paper's."""
    prices = resolve_prices(preset, switch_price, link_price, local_link_price, endpoint_price)
    rows = price_table(prices, radix, planes, endpoint_cables=endpoint_price is not None)
    headers = ["row", "endpoints", "switches", "links", "cost M$", "paper M$", "k$ per endpoint", "paper k$/EP",
               "match"]
    table = []
    for r in rows:
        paper = r.get("paper", {})
        match = r.get("matches_paper")
        table.append([r["row"], r["endpoints"], r["switches"], r["links"], round(r["cost_musd"], 1),
                      paper.get("cost_musd"), round(r["cost_per_endpoint_kusd"], 3),
                      paper.get("cost_per_endpoint_kusd"),
                      "" if match is None else ("yes" if all(match.values()) else "no")])
    notes = [r["note"] for r in rows if r["note"]] + [
        "Table 3 counts switch-to-switch links only; endpoint cables are priced only with --endpoint-price",
        "the paper gives no unit prices; presets are reconstructions (see docs/network.md)",
    ]
    payload = {"preset": preset, "prices": asdict(prices),
               "preset_description": PRESETS[preset][1], "rows": rows, "notes": notes}
    text = format_table(headers, table, markdown) + "\n" + format_notes(notes, 10**6 if markdown else None)
    _emit(payload, as_json, text)


def _sim_config(**o) -> SimConfig:
    if o["traffic"] not in TRAFFICS:
        raise DSV3Error(f"--traffic must be one of {', '.join(TRAFFICS)}")
    spec = _spec(o["topology"], o["radix"], o["planes"], o["rails"], o["q"], o["p"], o["a"], o["h"], o["g"],
                 o["gpus"], o["gpus_per_node"])
    ep = EPSpec(tokens_per_gpu=o["tokens"], hidden=o["hidden"], experts=o["experts"], topk=o["topk"],
                node_limit=o["node_limit"], dedup=o["dedup"], ep_size=o["ep"], expert_skew=o["expert_skew"])
    return SimConfig(
        topology=spec, traffic=o["traffic"], routing=o["routing"], message_bytes=parse_bytes(o["message_bytes"]),
        fail_plane=o["fail_plane"], fail_links=o["fail_links"], fail_switches=o["fail_switches"],
        speeds=LinkSpeeds(o["nic_gbps"], o["switch_gbps"], o["nvlink_gbs"]), link_layer=o["link_layer"],
        qps=o["qps"], relay=o["relay"], pxn=o["pxn"], group=o["group"], group_size=o["group_size"],
        placement=o["placement"], incast_sources=o["incast_sources"], shift=o["shift"], ep=ep, seed=o["seed"],
        rtol=o["rtol"],
    )


def _sim_text(r: dict, markdown: bool) -> str:
    t = r["traffic"]
    rows = [["time", fmt_seconds(r["time_us"] * 1e-6)],
            ["fluid time per step", fmt_seconds(r["step"]["fluid_us"] * 1e-6)],
            ["latency per step", fmt_seconds(r["step"]["latency_us"] * 1e-6)], ["steps", t["steps"]],
            ["size S", human_bytes(t["size_bytes"])], ["algbw per GPU (GB/s)", r["algbw_GBps"]],
            ["busbw (GB/s)", r["busbw_GBps"]], ["NIC tx mean (GB/s)", r["nic"]["tx_GBps_mean"]],
            ["NVLink-forwarded bytes", fmt_bytes(r["bytes"]["forwarded_over_nvlink"])]]
    for kind, u in r["link_utilization"].items():
        if u["links"]:
            rows.append([f"{kind} utilization mean / max", f"{u['mean']:.3f} / {u['max']:.3f}"])
    if "ib_copies_per_token" in t:
        rows.append(["IB copies per token", t["ib_copies_per_token"]])
        rows.append(["inter-node bytes per token", t["internode_bytes_per_token"]])
    head = f"{r['topology']['kind'].upper()} {r['gpus']} GPUs, {t['kind']}, {r['routing']} routing"
    return head + "\n" + format_table(["metric", "value"], rows, markdown)


_TOPO_OPTS = dict(
    radix=typer.Option(64, "--radix", "-k", help="switch radix"),
    planes=typer.Option(8, help="MPFT planes"), rails=typer.Option(8, help="MRFT rails"),
    q=typer.Option(5, help="Slim Fly q"), p=typer.Option(4, help="Dragonfly p"), a=typer.Option(8, help="Dragonfly a"),
    h=typer.Option(4, help="Dragonfly h"), g=typer.Option(None, help="Dragonfly g"),
    gpus_per_node=typer.Option(8, help="GPUs (and NICs) per node"),
)


@app.command()
def simulate(
    topology: str = typer.Option("mpft", "--topology", help="ft2 | ft3 | mpft | mrft | sf | df"),
    gpus: int = typer.Option(128, "--gpus", help="GPUs (endpoints) in the job"),
    traffic: str = typer.Option("alltoall", help=" | ".join(TRAFFICS)),
    routing: str = typer.Option("adaptive", help="adaptive | ecmp | static"),
    message_bytes: str = typer.Option("256MiB", help="NCCL-tests size S (e.g. 4096, 256MiB, 1GiB)"),
    fail_plane: int = typer.Option(None, help="fail every switch of this plane (MPFT) or rail (MRFT)"),
    fail_links: int = typer.Option(0, help="fail this many random switch-to-switch links"),
    fail_switches: int = typer.Option(0, help="fail this many random switches"),
    nic_gbps: float = typer.Option(400.0, help="NIC line rate, Gb/s per direction"),
    switch_gbps: float = typer.Option(None, help="switch-to-switch link rate (default: NIC rate)"),
    nvlink_gbs: float = typer.Option(160.0, "--nvlink-GBps", help="NVLink GB/s per GPU per direction"),
    link_layer: str = typer.Option("ib", help="ib | roce (Table 5 latencies)"),
    qps: int = typer.Option(1, help="queue pairs per connection (ECMP hashes each separately)"),
    relay: str = typer.Option("source", help="cross-plane forwarding: source (PXN) | dest (DeepEP)"),
    pxn: bool = typer.Option(False, help="MRFT: forward over NVLink to the destination's rail, as NCCL PXN"),
    group: str = typer.Option("dp", help="ring collectives: dp | tp | world"),
    group_size: int = typer.Option(None, help="ring size (nodes for dp, GPUs for tp)"),
    placement: str = typer.Option("linear", help="linear | random node order in rings"),
    incast_sources: int = typer.Option(8, help="senders for --traffic incast"),
    shift: int = typer.Option(None, help="--traffic permutation: partner offset (default half the GPUs)"),
    tokens: int = typer.Option(4096, help="EP: tokens per GPU"),
    hidden: int = typer.Option(7168, help="EP: hidden size"),
    experts: int = typer.Option(256, help="EP: routed experts"),
    topk: int = typer.Option(8, help="EP: experts per token"),
    node_limit: int = typer.Option(4, help="EP: max nodes per token (0 = no limit)"),
    dedup: bool = typer.Option(True, help="EP: one IB copy per destination node"),
    ep: int = typer.Option(None, "--ep", help="EP: GPUs per EP group, the expert-parallel degree (default all)"),
    expert_skew: float = typer.Option(0.0, help="EP: std of per-expert popularity (logit offset)"),
    seed: int = typer.Option(0),
    rtol: float = typer.Option(1e-3, help="0 = exact max-min; larger = faster with bounded error"),
    plot_dir: Path = typer.Option(None, help="write a link-utilization histogram PNG here"),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
    radix: int = _TOPO_OPTS["radix"], planes: int = _TOPO_OPTS["planes"], rails: int = _TOPO_OPTS["rails"],
    q: int = _TOPO_OPTS["q"], p: int = _TOPO_OPTS["p"], a: int = _TOPO_OPTS["a"], h: int = _TOPO_OPTS["h"],
    g: int = _TOPO_OPTS["g"], gpus_per_node: int = _TOPO_OPTS["gpus_per_node"],
) -> None:
    """Simulate one traffic pattern: completion time, algbw/busbw per GPU, link utilization."""
    cfg = _sim_config(**{k_: v for k_, v in locals().items() if k_ not in ("plot_dir", "as_json", "markdown")})
    with _progress(gpus >= 512) as update:
        report = run_simulation(cfg, update, keep_arrays=plot_dir is not None)
    arrays = report.pop("_arrays", None)
    if plot_dir is not None:
        from dsv3.network.fabric import LINK_KIND_NAMES

        util = {name: arrays["util"][arrays["live"] & (arrays["kinds"] == code)]
                for code, name in LINK_KIND_NAMES.items()}
        name = f"util_{topology}_{gpus}_{traffic}_{routing}.png"
        title = f"{topology.upper()} {gpus} GPUs, {traffic}, {routing}"
        report["plots"] = [str(plot_utilization(util, title, plot_dir / name))]
    _emit(report, as_json, _sim_text(report, markdown))


@app.command("sweep")
def sweep_cmd(
    topologies: str = typer.Option("mpft,mrft,ft3", help="comma-separated kinds"),
    gpus: str = typer.Option("16,32,64,128", help="comma-separated GPU counts"),
    sizes: str = typer.Option("128MiB,256MiB,512MiB,1GiB,2GiB,4GiB,8GiB,16GiB", help="message sizes",
                              show_default="128MiB,256MiB,...,16GiB (powers of 2)"),
    routings: str = typer.Option("adaptive", help="comma-separated: adaptive,ecmp,static"),
    traffic: str = typer.Option("alltoall", help=" | ".join(TRAFFICS[:5])),
    group: str = typer.Option("dp"), placement: str = typer.Option("linear"),
    pxn: bool = typer.Option(False), link_layer: str = typer.Option("ib"), qps: int = typer.Option(1),
    seed: int = typer.Option(0), rtol: float = typer.Option(1e-3),
    plot_dir: Path = typer.Option(None, help="write bandwidth-vs-size and bandwidth-vs-GPUs PNGs here"),
    as_json: bool = typer.Option(False, "--json"), markdown: bool = typer.Option(False, "--markdown"),
    radix: int = _TOPO_OPTS["radix"], planes: int = _TOPO_OPTS["planes"], rails: int = _TOPO_OPTS["rails"],
) -> None:
    """Bandwidth over topologies x GPU counts x routing policies x message sizes (tables and plots)."""
    try:
        kinds = [s.strip() for s in topologies.split(",") if s.strip()]
        counts = [int(x) for x in gpus.split(",")]
        size_list = sorted(parse_bytes(x) for x in sizes.split(","))
        routing_list = [s.strip() for s in routings.split(",") if s.strip()]
    except ValueError as exc:
        raise DSV3Error(f"cannot read the sweep lists: {exc}") from exc
    if traffic.startswith("ep-"):
        raise DSV3Error("sweep scales message sizes; use `dsv3 net simulate` for EP traffic")
    base = SimConfig(topology=TopologySpec(k=radix, planes=planes, rails=rails), traffic=traffic, group=group,
                     placement=placement, pxn=pxn, link_layer=link_layer, qps=qps, seed=seed, rtol=rtol)
    with _progress(max(counts) >= 512) as update:
        rows = sweep(base, kinds, counts, size_list, routing_list, update)
    payload: dict = {"traffic": traffic, "rows": rows}
    if plot_dir is not None:
        payload["plots"] = [str(p_) for p_ in plot_sweep(rows, traffic, plot_dir)]
    table = [[r["topology"], r["gpus"], r["routing"], human_bytes(r["message_bytes"]), fmt_seconds(r["time_us"] * 1e-6),
              r["algbw_GBps"], r["busbw_GBps"]] for r in rows]
    text = format_table(["topology", "GPUs", "routing", "size", "time", "algbw GB/s", "busbw GB/s"], table, markdown)
    _emit(payload, as_json, text)
