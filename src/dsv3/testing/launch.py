"""Run a function on W local processes joined by a gloo group on 127.0.0.1, with a hard deadline.

Used by `dsv3 bench ep` and the tests. Each process gets one torch thread (the machine may have two
cores); a hang becomes an error after ``timeout_s`` instead of blocking forever; a worker's exception
comes back as a `DSV3Error` naming the rank, with its traceback's last line.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3.errors import DSV3Error


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # report every failure to the parent, then exit
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})" if frame else ""
        results.put(
            (rank, "error", str(err) if isinstance(err, DSV3Error) else f"{type(err).__name__}: {err}{where}")
        )


def launch(fn: Callable, world: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; returns their results by rank.

    ``fn`` must be importable by name (a module-level function of an installed module).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dsv3.testing.ep_scenarios"])
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, timeout_s, fn, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: list = [None] * world
    errors = []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout_s + 60)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                break
    except queue.Empty:
        errors.append(f"workers did not finish within {timeout_s + 60:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise DSV3Error("; ".join(errors))
    return out


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the local ``dsv3`` process of ``rank`` (RANK in its environment, as torchrun sets it) whose
    command line names ``run_dir``, to signal one rank of a running group; None when there is none."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and str(run_dir).encode() in cmdline and b"dsv3" in cmdline:
            return int(pid)
    return None


def train_steps_done(run_dir: Path) -> int:
    """How many optimizer steps a running ``dsv3 train`` has logged in ``run_dir``/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return sum('"kind": "train"' in line for line in path.read_text().splitlines()) if path.exists() else 0
