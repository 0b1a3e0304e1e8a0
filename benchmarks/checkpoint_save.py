"""Sharded (DCP) checkpoint saves against the gathered HF save they replaced, per layout, on gloo CPU processes.

For each layout the same processes build a model, take one AdamW step (so that the optimizer has its
moments), then alternate, ``--repeats`` times each, between

* **sharded**: `Parallelized.save_state` (torch.distributed.checkpoint, every rank writes what it holds);
* **gathered**: what a checkpoint was before: `Parallelized.full_model()` (every expert, shard and stage
  gathered onto every rank), rank 0 writing the whole model with ``save_pretrained``, every rank writing
  its optimizer state with ``torch.save``.

Reported per layout: the median wall time of each (the slowest rank, between barriers), its ratio, and the
bytes each rank wrote. Interleaved in one run, so the ratio holds on a busy machine; re-run on an idle
one for absolute times:

    .venv/bin/python benchmarks/checkpoint_save.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"ep2": dict(dp=2, ep=2, gpus_per_node=2), "fsdp2": dict(dp=2, dp_shard="fsdp"),
           "zero1x2": dict(dp=2, dp_shard="zero1"), "pp2": dict(pp=2)}


def worker(layout_name: str, preset: str, repeats: int, root: Path) -> None:
    """One rank: build, step once, then time the two saves alternately; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    from dsv3.config import preset as model_preset
    from dsv3.layout import Layout
    from dsv3.model.transformer import Transformer
    from dsv3.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(model_preset(preset)).train()
    layout = Layout(**{"dispatch": "fp32", **LAYOUTS[layout_name]})
    parallel = parallelize(model, layout)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (layout.pp * 2, 32), generator=torch.Generator().manual_seed(1))
    parallel.forward_backward([(ids, ids)], torch.autocast("cpu", enabled=False), 1)
    parallel.sync_and_clip(1.0)
    optimizer.step()
    times: dict[str, list[float]] = {"sharded": [], "gathered": []}
    written: dict[str, int] = {}
    for i in range(repeats):
        for kind in ("sharded", "gathered"):
            folder = root / f"{kind}-{i}"
            dist.barrier()
            t0 = time.perf_counter()
            written[kind] = _save(kind, parallel, optimizer, folder, rank)
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[kind].append(float(elapsed))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, written)
    if rank == 0:
        sharded, gathered = (statistics.median(times[k]) for k in ("sharded", "gathered"))
        print(json.dumps({"layout": layout_name, "preset": preset, "repeats": repeats,
                          "sharded_s": round(sharded, 4), "gathered_s": round(gathered, 4),
                          "gathered_over_sharded": round(gathered / sharded, 2),
                          "bytes_per_rank": {k: [w[k] for w in per_rank] for k in ("sharded", "gathered")}}))
    dist.barrier()
    dist.destroy_process_group()


def _save(kind: str, parallel, optimizer, folder: Path, rank: int) -> int:
    """One save of ``kind``; returns the bytes this rank wrote."""
    import torch

    if kind == "sharded":
        parallel.save_state(folder, optimizer)
        return sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))
    full = parallel.full_model()
    mine = folder / f"optimizer.rank{rank}.pt"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), mine)
    size = mine.stat().st_size
    if rank == 0:
        full.save_pretrained(folder / "hf")
        size += sum(f.stat().st_size for f in (folder / "hf").iterdir())
    return size


def drive(layouts: list[str], preset: str, repeats: int, timeout: float) -> list[dict]:
    """Every layout on 2 processes (this script re-run as each rank); the rows rank 0 printed."""
    rows = []
    for name in layouts:
        with tempfile.TemporaryDirectory(prefix="dsv3-ckpt-bench-") as tmp:
            port = _free_port()
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": "2"}
            cmd = [sys.executable, __file__, "--worker", name, "--preset", preset, "--repeats", str(repeats),
                   "--root", tmp]
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
            outs = [p.communicate(timeout=timeout) for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"error: layout {name} failed: {outs[0][1][-2000:]}{outs[1][1][-2000:]}")
            rows.append(json.loads(outs[0][0].strip().splitlines()[-1]))
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--preset", default="nano", help="model preset (nano: 3.25M parameters; small: about 100M)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.preset, args.repeats, Path(args.root))
        return
    unknown = [n for n in args.layouts.split(",") if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"error: unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    rows = drive(args.layouts.split(","), args.preset, args.repeats, args.timeout)
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    for r in rows:
        b = r["bytes_per_rank"]
        print(f"{r['layout']:>8}: sharded {r['sharded_s']:.3f} s, gathered {r['gathered_s']:.3f} s "
              f"({r['gathered_over_sharded']}x); bytes per rank sharded {b['sharded']}, gathered {b['gathered']}")


if __name__ == "__main__":
    main()
