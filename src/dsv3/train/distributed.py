"""Data parallelism over torch.distributed: gloo on CPU, NCCL on GPU, set up from torchrun's variables.

A single process is a world of size 1 and every collective here is then a no-op, so the training loop
reads the same with and without torchrun.

A process that dies (or hangs) must not leave the others waiting forever: every collective of the process
group times out after ``--dist-timeout`` seconds (a dead peer's closed connection fails gloo's collectives
at once), and `peer_failures` turns such a failure into one `DSV3Error` line naming the rank, the cause and
the last checkpoint, instead of a traceback (every surviving rank says it: rank 0 may be the one that died).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsv3.errors import DSV3Error, RankError
from dsv3.layout import Layout

# The EP dispatch's wire format by training precision (V3: FP8 dispatch; the combine follows, FP8 -> BF16).
DISPATCH_FORMATS = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8"}


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place; returns t."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (e.g. "a stop signal arrived")."""
        return bool(self.max_(torch.tensor([float(flag)], device=self.device)).item())


DEFAULT_TIMEOUT_S = 600.0  # NCCL's own default; gloo's is 30 min, long for a run whose peer hung
# How a collective reports a peer that died (gloo: its connection closed) or hung (a timeout).
PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "connection refused",
                        "broken pipe", "timed out")


def setup_world(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join torchrun's process group when WORLD_SIZE > 1 (collectives time out after ``timeout_s``); pick
    this rank's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _device(device, local_rank)
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout)
        _groups_time_out_after(timeout)
    return World(rank=rank, size=size, local_rank=local_rank, device=dev)


def _groups_time_out_after(timeout: datetime.timedelta) -> None:
    """Make the process groups created later in this process (EP, replica, pipeline, FSDP mesh groups) time
    out like the world: ``new_group`` without a timeout takes torch's module default (30 min for gloo), not
    the world's, and layouts create their groups without one. Only a process that set up its own world (the
    trainer's) changes it."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def teardown_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        with contextlib.suppress(RuntimeError):  # a group whose peer died may fail to shut down cleanly
            dist.destroy_process_group()


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another process died or stopped answering."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in PEER_FAILURE_MARKERS)


@contextlib.contextmanager
def peer_failures(world: World, run_dir: Path, timeout_s: float) -> Iterator[None]:
    """Within the block, a collective that fails because a peer died or hung ends as one DSV3Error line."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        if not world.distributed or not is_peer_failure(exc):
            raise
        raise RankError(lost_peer_message(world, exc, run_dir, timeout_s)) from None


def lost_peer_message(world: World, exc: BaseException, run_dir: Path, timeout_s: float) -> str:
    """One line: which rank stopped, the collective's own reason (its first meaningful line), what is on disk."""
    from dsv3.train.checkpoints import latest_checkpoint
    from dsv3.train.options import resume_command

    text = " ".join(re.sub(r"\[[^\]]*:\d+\]", " ", str(exc)).split())  # without gloo's [file.cc:553]
    reason = text.split(". ")[0][:160] or type(exc).__name__
    latest = latest_checkpoint(Path(run_dir))
    saved = f"last checkpoint {latest}; continue with: {resume_command(run_dir, world.size)}" if latest else \
        "no checkpoint was saved"
    return (f"rank {world.rank} of {world.size} stopped: another process of the run died or did not answer "
            f"within --dist-timeout {timeout_s:g} s ({reason}); {saved}")


def _device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DSV3Error("--device cuda was asked for but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if name == "cpu":
        return torch.device("cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise DSV3Error(f"unknown --device {name!r}; use auto, cpu or cuda") from None


def training_layout(opts, world: World, fit: bool = False, n_experts: int | None = None) -> Layout:
    """The layout ``dsv3 train``'s options ask for on this world: ``--pp`` pipeline stages, data parallel
    over the rest (every process without --pp), the routed experts over ``--ep`` of them,
    ``--moe-output-format`` as the (real or simulated) combine. With ``fit`` (a resume without layout
    flags), a layout this world cannot hold becomes the nearest one it can (`Layout.fitted`)."""
    asked = _asked_layout(opts, world.size)
    try:
        pp = opts.pp or 1
        if world.size % pp:
            raise DSV3Error(
                f"--pp {pp} needs a multiple of {pp} processes (dsv3 launch --nproc {pp} train ... --pp {pp}), "
                f"but {world.size} are running"
            )
        return asked.check(world.size)
    except DSV3Error:
        if not fit:
            raise
        return asked.fitted(world.size, n_experts).check(world.size)


def _asked_layout(opts, world_size: int) -> Layout:
    pp = opts.pp or 1
    return Layout(
        pp=pp,
        dp=max(1, world_size // pp),
        schedule=opts.pp_schedule,
        microbatches=opts.microbatches,
        ep=opts.ep or 1,
        dp_shard=opts.dp_shard,
        gpus_per_node=opts.gpus_per_node,
        dispatch=DISPATCH_FORMATS[opts.precision],
        combine=opts.moe_output_format,
    )
