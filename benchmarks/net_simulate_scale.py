"""How the flow-level simulator scales: all-to-all over MPFT from 2,048 toward 16,384 endpoints.

Each size runs in its own process (so peak memory is per size) and the script prints one JSON object:
wall time split into build (traffic, segments, routing) and drain (max-min events), flows, peak RSS,
and the fitted growth exponent of wall time in the GPU count. Peer row: MRFT with the same traffic.

    .venv/bin/python benchmarks/net_simulate_scale.py                     # 2048, 4096, 8192
    .venv/bin/python benchmarks/net_simulate_scale.py --gpus 2048,16384 --routing ecmp
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys


def one(kind: str, gpus: int, routing: str) -> dict:
    from dsv3.network.catalog import TopologySpec
    from dsv3.network.simulate import SimConfig, run_simulation

    r = run_simulation(SimConfig(topology=TopologySpec(kind=kind, endpoints=gpus), routing=routing))
    return {"topology": kind, "gpus": gpus, "routing": routing, "algbw_GBps": r["algbw_GBps"],
            "wall_s": r["wall_s"], "flows": r["flows"],
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="2048,4096,8192", help="comma-separated endpoint counts")
    ap.add_argument("--routing", default="adaptive")
    ap.add_argument("--peer", default="mrft", help="topology run beside MPFT at sizes it can hold ('' = none)")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "GPUS", "ROUTING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.one[2])))
        return
    rows = []
    for n in [int(x) for x in args.gpus.split(",")]:
        kinds = ["mpft"] + ([args.peer] if args.peer and n <= 2048 else [])
        for kind in kinds:
            out = subprocess.run([sys.executable, __file__, "--one", kind, str(n), args.routing],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout))
            print(f"{kind} {n}: {rows[-1]['wall_s']['total']:.1f} s", file=sys.stderr)
    mpft = [r for r in rows if r["topology"] == "mpft"]
    growth = None
    if len(mpft) >= 2:
        a, b = mpft[0], mpft[-1]
        growth = math.log(b["wall_s"]["total"] / a["wall_s"]["total"]) / math.log(b["gpus"] / a["gpus"])
    print(json.dumps({"benchmark": "net_simulate_scale", "traffic": "alltoall 256MiB", "rows": rows,
                      "wall_time_exponent_in_gpus": growth,
                      "note": "network flows grow as nodes^2 x planes; time ~ flows (numpy passes)"}))


if __name__ == "__main__":
    main()
