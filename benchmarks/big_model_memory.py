"""Peak resident memory (VmHWM) of every rank of a model larger than one process's share, against that share:
a random V3-shaped checkpoint (bf16, mostly routed experts) written by transformers, then N processes
(torchrun, so that earlier code runs it too) either serve it (`dsv3 serve --ep 4`: each rank's VmHWM after
one completion) or fine-tune it (`dsv3 train --init-from`: each rank's VmHWM at the end of its first step,
which the trainer records in RUN/run.json; the run is then stopped, before its checkpoint is written).

    .venv/bin/python benchmarks/big_model_memory.py --json                       # every scenario
    .venv/bin/python benchmarks/big_model_memory.py --scenarios serve-ep4 --json
    PYTHONPATH=/path/to/other/src .venv/bin/python benchmarks/big_model_memory.py --scenarios serve-ep4

A rank's share: serving, its weights (its experts' bytes plus every other tensor's: each rank holds the
whole dense part); training, its weights, gradients and AdamW state as the trainer counts them from its
tensors (RUN/run.json's ``memory.per_rank``: fp32 master weights, so 16 bytes per parameter it holds).
The baseline is a process that imports torch and dsv3 and does nothing else (its VmHWM), measured in the
same run. Linux only."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

GB = 1e9
TRAIN_SCENARIOS = {
    "train-pp2-ep2": ["--pp", "2", "--micro-batches", "2", "--ep", "2"],
    "train-ep4-fsdp": ["--ep", "4", "--dp-shard", "fsdp"],
}
SERVE_SCENARIOS = {  # name: (extra flags, ranks of an EP group: each holds 1/this of the routed experts)
    "serve-ep4": ([], 4),
    "serve-ep4-prefill2": (["--prefill-ranks", "2"], 2),  # 2 prefill ranks and 2 decode ranks, each an EP group
}
SCENARIOS = (*SERVE_SCENARIOS, *TRAIN_SCENARIOS)


def make_checkpoint(folder: Path, layers: int, experts: int) -> dict:
    """A random bf16 checkpoint written by transformers' DeepseekV3ForCausalLM.save_pretrained, with
    ``layers`` MoE layers of ``experts`` routed experts; its byte counts. The model is built on ``meta``
    and given random bf16 values tensor by tensor (no fp32 copy, no slow initializer)."""
    import torch
    import transformers

    from dsv3.config import preset

    cfg = preset("small").replace(vocab_size=4096, hidden_size=1024, num_hidden_layers=layers,
                                  first_k_dense_replace=0, n_routed_experts=experts, moe_intermediate_size=512,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, num_nextn_predict_layers=0,
                                  torch_dtype="bfloat16")
    config = transformers.DeepseekV3Config.from_dict(cfg.to_dict(rope_layout="new"))
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    routed = other = 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                t.fill_(1.0)
            elif "bias" in name:
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=gen)
            nbytes = t.numel() * t.element_size()
            if ".mlp.experts." in name:
                routed += nbytes
            else:
                other += nbytes
    model.save_pretrained(folder)
    return {"checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
            "routed_expert_bytes": routed, "other_bytes": other, "experts": experts,
            "parameters": sum(p.numel() for p in model.parameters())}


def vm_hwm(pid: int | str) -> int:
    """Peak resident bytes of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024


def baseline(module: str) -> int:
    """VmHWM of a process that imports torch and ``module`` and does nothing."""
    code = (f"import re, torch, {module}; "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) * 1024


def workers(launcher: int, command: bytes) -> list[int]:
    """The ``command`` processes (serve, train) under the launcher, by pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if command in cmd and b"-m" in cmd and int(entry.name) != launcher and _descends(int(stat[1]), launcher):
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


def _torchrun(nproc: int, args: list[str], **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "dsv3", *args]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, **popen)


def _stop(proc: subprocess.Popen, command: bytes) -> None:
    """End the launcher and its ranks (by their ids) without letting them write anything more."""
    for pid in [*workers(proc.pid, command), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def serve_and_measure(folder: Path, ep: int, extra: list[str]) -> list[int]:
    """Every rank's VmHWM after start-up and one completion, serving ``folder`` with --ep ``ep``."""
    proc = _torchrun(ep, ["serve", "--model", str(folder), "--ep", str(ep), "--port", "0", "--quiet",
                          "--threads", "1", *extra], stderr=subprocess.PIPE)
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
        return [vm_hwm(pid) for pid in workers(proc.pid, b"serve")]
    finally:
        _stop(proc, b"serve")


def train_and_measure(folder: Path, data: Path, run: Path, layout: list[str], timeout_s: float) -> list[dict]:
    """Every rank's memory record after the first step of fine-tuning ``folder`` on 4 processes under
    ``layout``: its share (parameters, gradients, optimizer state) and its VmHWM then (RUN/run.json)."""
    args = ["train", "--init-from", str(folder), "--data", str(data), "--out", str(run), "--steps", "2",
            "--batch-size", "4", "--seq-len", "32", "--eval-tokens", "128", "--val-fraction", "0.2",
            "--cache-dir", str(run.parent / "cache"), "--device", "cpu", "--threads", "1", "--tokenizer", "dsv3",
            *layout]
    proc = _torchrun(4, args, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"error: the training run ended (exit {proc.returncode}) before its first step's record")
            try:
                memory = json.loads((run / "run.json").read_text()).get("memory")
            except (OSError, json.JSONDecodeError):
                memory = None
            if memory:
                return [{**rank, "resident_peak": peak} for rank, peak in zip(memory["per_rank"],
                                                                            memory["resident_peak"], strict=True)]
            time.sleep(0.5)
        sys.exit(f"error: no first step within {timeout_s:.0f} s")
    finally:
        _stop(proc, b"train")


def tiny_corpus(folder: Path) -> Path:
    """A few hundred KB of text: enough for the BPE tokenizer and one step, small beside the model."""
    import random

    folder.mkdir()
    words = "def class return import value for in range if else while yield lambda print the data".split()
    rng = random.Random(0)
    for i in range(8):
        (folder / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                                                      for _ in range(400)))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a training run may take to its first step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chosen = args.scenarios.split(",")
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        sys.exit(f"error: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "big"
        sizes = make_checkpoint(folder, args.layers, args.experts)
        data = tiny_corpus(Path(tmp) / "data")
        result = {**sizes, "scenarios": {}}
        for name in chosen:
            if name in SERVE_SCENARIOS:
                extra, group = SERVE_SCENARIOS[name]
                base = baseline("dsv3.infer.server")
                peaks = serve_and_measure(folder, 4, extra)
                share = sizes["other_bytes"] + sizes["routed_expert_bytes"] / group
                ranks = [{"rank": r, "vm_hwm_bytes": p, "share_bytes": share} for r, p in enumerate(peaks)]
            else:
                base = baseline("dsv3.train.run")
                records = train_and_measure(folder, data, Path(tmp) / name, TRAIN_SCENARIOS[name], args.timeout)
                ranks = [{"rank": r["rank"], "vm_hwm_bytes": r["resident_peak"],
                          "share_bytes": r["parameters"] + r["gradients"] + r["optimizer"]} for r in records]
            for r in ranks:
                r["over_share_plus_baseline"] = (r["vm_hwm_bytes"] - base) / r["share_bytes"]
            result["scenarios"][name] = {"baseline_bytes": base, "ranks": ranks}
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint {sizes['checkpoint_bytes'] / GB:.2f} GB ({sizes['routed_expert_bytes'] / GB:.2f} GB routed "
          f"experts), written by transformers")
    for name, scenario in result["scenarios"].items():
        print(f"{name}: baseline {scenario['baseline_bytes'] / GB:.2f} GB")
        for r in scenario["ranks"]:
            print(f"  rank {r['rank']}: VmHWM {r['vm_hwm_bytes'] / GB:.2f} GB, share {r['share_bytes'] / GB:.2f} GB: "
                  f"baseline + {r['over_share_plus_baseline']:.2f} x share")


if __name__ == "__main__":
    main()
