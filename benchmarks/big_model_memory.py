"""Peak resident memory (VmHWM) of every rank of `dsv3 serve --ep N` against the rank's share of the
weights: a random V3-shaped checkpoint (bf16, mostly routed experts) is written, N processes serve it
(torchrun, so that earlier code runs it too), one completion runs, and each rank's VmHWM is read from /proc once it has.

    .venv/bin/python benchmarks/big_model_memory.py --ep 4 --json
    PYTHONPATH=/path/to/other/src .venv/bin/python benchmarks/big_model_memory.py --ep 4   # other code

The baseline is a process that imports torch and dsv3 and does nothing else (its VmHWM); a rank's share
is its experts' bytes plus every other tensor's (each rank holds the whole dense part). Linux only."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

GB = 1e9


def make_checkpoint(folder: Path, layers: int, experts: int) -> dict:
    """A random bf16 checkpoint with ``layers`` MoE layers of ``experts`` routed experts; its byte counts."""
    import torch

    from dsv3.config import preset
    from dsv3.model import Transformer
    from dsv3.model.moe import stays_fp32

    cfg = preset("small").replace(vocab_size=4096, hidden_size=1024, num_hidden_layers=layers,
                                  first_k_dense_replace=0, n_routed_experts=experts, moe_intermediate_size=512,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.save_pretrained(folder, dtype=torch.bfloat16)
    routed = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() * (4 if stays_fp32(n) else 2) for n, p in model.named_parameters())
    return {"checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
            "routed_expert_bytes": routed, "other_bytes": total - routed, "experts": experts}


def vm_hwm(pid: int) -> int:
    """Peak resident bytes of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024


def baseline() -> int:
    """VmHWM of a process that imports torch and dsv3's serving code and does nothing."""
    code = ("import re, torch, dsv3.infer.server; "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) * 1024


def workers(launcher: int) -> list[int]:
    """The serving processes under the launcher (its children's python children), by rank order of start."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd and b"-m" in cmd and int(entry.name) != launcher and _descends(int(stat[1]), launcher):
                found.append(int(entry.name))
    return sorted(found)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def serve_and_measure(folder: Path, ep: int) -> list[int]:
    """Every rank's VmHWM after start-up and one completion, serving ``folder`` with --ep ``ep``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ep), "-m", "dsv3",
           "serve", "--model", str(folder), "--ep", str(ep), "--port", "0", "--quiet", "--threads", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)/v1", line)
            if m:
                url = m[1]
                break
        if url is None:
            sys.exit(f"error: the server did not start (exit {proc.wait()})")
        body = json.dumps({"model": folder.name, "prompt": [1, 2, 3, 4], "max_tokens": 8}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=600).read()
        return [vm_hwm(pid) for pid in workers(proc.pid)]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "big"
        sizes = make_checkpoint(folder, args.layers, args.experts)
        base = baseline()
        time.sleep(1)
        peaks = serve_and_measure(folder, args.ep)
    share = sizes["other_bytes"] + sizes["routed_expert_bytes"] / args.ep
    result = {**sizes, "ep": args.ep, "baseline_bytes": base, "share_bytes": share, "vm_hwm_bytes": peaks,
              "over_share_plus_baseline": [(p - base) / share for p in peaks]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint {sizes['checkpoint_bytes'] / GB:.2f} GB ({sizes['routed_expert_bytes'] / GB:.2f} GB routed "
          f"experts); --ep {args.ep}: a rank's share {share / GB:.2f} GB, baseline {base / GB:.2f} GB")
    for rank, peak in enumerate(peaks):
        print(f"rank {rank}: VmHWM {peak / GB:.2f} GB = baseline + {(peak - base) / share:.2f} x share")


if __name__ == "__main__":
    main()
