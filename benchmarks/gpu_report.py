"""Markdown tables from the JSON lines of `benchmarks/gpu_check.sh` (what docs/gpu.md quotes).

    bash benchmarks/gpu_check.sh > gpu_check.log; python benchmarks/gpu_report.py gpu_check.log
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def read(path: str) -> dict[str, list[dict]]:
    rows = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                rows[row.get("check", "?")].append(row)
    return rows


def table(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def sections(rows: dict[str, list[dict]]) -> str:
    out = []
    machine = rows["machine"][0] if rows["machine"] else {}
    out.append(f"Machine: {', '.join(machine.get('gpus', []))}; torch {machine.get('torch')}, "
               f"CUDA {machine.get('cuda')}, Python {machine.get('python')}.")  # fmt: skip
    out.append(table(["section", "exit status", "seconds"],
                     [[r["name"], r["rc"], r["seconds"]] for r in rows["section"]]))  # fmt: skip
    fp8 = rows["fp8_gemm"]
    out.append(table(["backend", "usable (128x128, 1x128)", "probe"],
                     [[r["backend"], ", ".join(str(v) for v in r["validated"].values()),
                       "; ".join(r.get("detail", {}).values()).replace("\n", " ")[:90]]
                      for r in fp8 if r.get("kind") == "backend"]))  # fmt: skip
    worst, count = defaultdict(float), defaultdict(int)
    for r in fp8:
        if r.get("kind") == "correctness":
            worst[r["backend"]] = max(worst[r["backend"]], r["rel_err_vs_float64"])
            count[r["backend"]] += 1
    out.append(table(["backend", "GEMMs checked", "worst normwise error vs float64"],
                     [[k, count[k], f"{v:.2e}"] for k, v in worst.items()]))  # fmt: skip
    out.append(table(["op", "M, N, K", "ms", "TFLOP/s"],
                     [[r["op"], ", ".join(map(str, r["mnk"])), f"{r['ms']:.3f}", f"{r['tflops']:.0f}"]
                      for r in fp8 if r.get("kind") == "speed" and "tflops" in r]))  # fmt: skip
    out.append(table(["check", "result"], [[r["name"], _fields(r)] for r in rows["model"]]))
    out.append(table(["check", "result"], [[r["name"], _fields(r)] for r in rows["logfmt"]]))
    acc = rows["accumulation"]
    out.append(table(["source", "K = 1024", "K = 4096", "K = 16384"],
                     [[r.get("reading") or f"{r['source']}, use_fast_accum={r['use_fast_accum']}",
                       *(f"{100 * v:.4f}%" for v in r["normwise"].values())] for r in acc if "normwise" in r]))
    out.append(table(["check", "result"], [[r["name"], _fields(r)] for r in rows["ep_nccl"]]))
    out.append(table(["check", "result"], [[r["name"], _fields(r)] for r in rows["decode"]]))
    out.append(table(["check", "result"], [[r["name"], _fields(r)] for r in rows["moe_seam"]]))
    return "\n\n".join(out)


def _fields(row: dict) -> str:
    skip = {"check", "name"}
    parts = []
    for k, v in row.items():
        if k in skip:
            continue
        if isinstance(v, float):
            v = f"{v:.3g}"
        elif isinstance(v, dict):
            v = "{" + ", ".join(f"{a}: {b:.2f}" if isinstance(b, float) else f"{a}: {b}" for a, b in v.items()) + "}"
        elif isinstance(v, str) and len(v) > 120:
            v = v[:120] + "..."
        parts.append(f"{k} {v}")
    return "; ".join(parts).replace("|", "/").replace("\n", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="gpu_check.sh output files; later files override sections")
    args = parser.parse_args()
    merged: dict[str, list[dict]] = defaultdict(list)
    for path in args.logs:
        for check, rows in read(path).items():
            if check == "section":  # per section name, the later run's line
                named = {r["name"]: r for r in merged[check]} | {r["name"]: r for r in rows}
                merged[check] = list(named.values())
            else:
                merged[check] = rows
    print(sections(merged))


if __name__ == "__main__":
    main()
