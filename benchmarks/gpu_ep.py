"""CUDA checks of expert parallelism over NCCL: the two-hop EP layer on CUDA tensors, forward and backward,
against the single-process `MoE` on the same GPU, for each wire format; then its time against that layer.

One GPU is usually all a lent machine has, and NCCL refuses two ranks on one device, so the script first
tries 2 ranks on the one GPU (reporting what NCCL says) and then runs the checks on as many ranks as there
are GPUs. With one rank every row still goes through both hops' `all_to_all_single` on NCCL (self-chunks),
so the CUDA code paths (count exchange, FP8/LogFMT encoding on the GPU, async work handles) are exercised.

JSON lines on stdout; exit 1 when a check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on 4 gloo processes on the CPU (to test this script).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import queue
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3.parallel.ep import make_expert_parallel
from dsv3.parallel.ep_groups import make_ep_groups
from dsv3.testing.ep_scenarios import LayerSpec, build_layer
from dsv3.testing.launch import free_port

DEVICE = os.environ.get("DSV3_GPU_CHECK_DEVICE", "cuda")
# (dispatch, combine, relative tolerance on outputs and input gradients)
FORMATS = [("fp32", "fp32", 1e-5), ("bf16", "bf16", 2e-2), ("fp8", "bf16", 8e-2), ("fp8", "logfmt10", 8e-2)]


def emit(**fields) -> None:
    print(json.dumps({"check": "ep_nccl", **fields}), flush=True)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check_formats(rank: int, world: int, gpus_per_node: int) -> list[dict]:
    """Each wire format: EP forward/backward of this rank's tokens vs the whole layer on this device."""
    rows = []
    for dispatch, combine, tol in FORMATS:
        spec = LayerSpec(nodes=world // gpus_per_node, gpus_per_node=gpus_per_node, experts=16, topk=4,
                         topk_groups=max(1, world // gpus_per_node // 2), tokens=64, hidden=256, inter=64,
                         dispatch=dispatch, combine=combine, seed=1)  # fmt: skip
        moe, x_all, g_all = build_layer(spec)
        moe = moe.to(DEVICE).train()
        x_all, g_all = x_all.to(DEVICE), g_all.to(DEVICE)
        reference = copy.deepcopy(moe)
        ep = make_expert_parallel(moe, make_ep_groups(gpus_per_node), None, dispatch, combine).train()
        x = x_all[rank : rank + 1].clone().requires_grad_()
        y = ep(x)
        (y.float() * g_all[rank : rank + 1]).sum().backward()
        x_ref = x_all.clone().requires_grad_()
        y_ref = reference(x_ref)
        (y_ref.float() * g_all).sum().backward()
        out_rel = _rel(y, y_ref[rank : rank + 1])
        grad_rel = _rel(x.grad, x_ref.grad[rank : rank + 1])
        rows.append(dict(dispatch=dispatch, combine=combine, output_rel_err=out_rel, grad_x_rel_err=grad_rel,
                         passed=out_rel <= tol and grad_rel <= tol, tolerance=tol))  # fmt: skip
    return rows


def time_layer(rank: int, world: int, gpus_per_node: int) -> dict:
    """Milliseconds of forward+backward: the EP layer (V3's fp8 dispatch / bf16 combine) vs the local MoE."""
    big = DEVICE == "cuda"  # the CPU rehearsal only checks that the code runs
    spec = LayerSpec(nodes=world // gpus_per_node, gpus_per_node=gpus_per_node, experts=64, topk=8,
                     topk_groups=1, tokens=4096 if big else 128, hidden=2048 if big else 256,
                     inter=512 if big else 64, dispatch="fp8", combine="bf16", dtype="bfloat16", seed=2)  # fmt: skip
    moe, x_all, g_all = build_layer(spec)
    moe = moe.to(DEVICE).train()
    local = copy.deepcopy(moe)
    ep = make_expert_parallel(moe, make_ep_groups(gpus_per_node), None, "fp8", "bf16").train()
    x = x_all[rank : rank + 1].to(DEVICE).requires_grad_()
    g = g_all[rank : rank + 1].to(DEVICE)

    def step(layer) -> None:
        (layer(x).float() * g).sum().backward()

    out = {}
    for name, layer in (("local_moe", local), ("ep_fp8_bf16", ep)):
        for _ in range(3):
            step(layer)
        _sync()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            step(layer)
        _sync()
        out[f"{name}_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    stages = ep.dispatcher.stage_seconds
    out["host_stage_share"] = {k: v / max(sum(stages.values()), 1e-12) for k, v in stages.items()}
    out.update(tokens_per_rank=spec.tokens, hidden=spec.hidden, experts=spec.experts, topk=spec.topk)
    return out


def _worker(rank: int, world: int, port: int, results) -> None:
    try:
        backend = "nccl" if DEVICE == "cuda" else "gloo"
        if DEVICE == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        try:
            gpus_per_node = 2 if world % 2 == 0 else 1
            value = {"formats": check_formats(rank, world, gpus_per_node),
                     "timing": time_layer(rank, world, gpus_per_node), "gpus_per_node": gpus_per_node}
            results.put((rank, "ok", value))
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", f"{type(err).__name__}: {err}"[:400] + traceback.format_exc()[-600:]))


def launch(world: int, timeout_s: float) -> tuple[list, str | None]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, error = [None] * world, None
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout_s)
            if status != "ok":
                error = f"rank {rank}: {value}"
                break
            out[rank] = value
    except queue.Empty:
        error = f"no answer within {timeout_s:.0f} s"
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    return out, error


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 4
    if DEVICE == "cuda" and gpus == 1:  # NCCL refuses it ("Duplicate GPU detected", H100, 2026-12-06)
        emit(name="two_ranks_one_gpu", skipped="NCCL runs one rank per GPU: two ranks need two GPUs")
    world = gpus if gpus in (1, 2, 4, 8) else 1
    out, error = launch(world, 150)
    if error is not None:
        emit(name="ep_layer", world=world, ok=False, error=error)
        return 1
    ok = True
    for rank, value in enumerate(out):
        for row in value["formats"]:
            ok &= row["passed"]
            emit(name="ep_layer_vs_single", world=world, rank=rank, **row)
    emit(name="ep_layer_speed", world=world, rank=0, gpus_per_node=out[0]["gpus_per_node"], **out[0]["timing"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
