"""`run_training` on the processes of `dsv3.testing.launch` (a gloo group already joined): what
``torchrun -m dsv3 train`` does on each rank, several runs in one launch, without starting a fresh
interpreter per rank and run, which keeps the sharded-training tests fast."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist


def train_worker(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Do ``runs`` in order as rank ``rank`` of ``world``; returns their summaries. Each run is a dict:
    ``options`` (TrainOptions fields), ``resume`` (bool), and optionally ``copy_from`` (a run folder that
    rank 0 copies to ``options["out"]`` first) with ``drop_after`` (remove the copy's checkpoints after that
    step, so that the resume starts there)."""
    from dsv3.train import run
    from dsv3.train.checkpoints import complete_checkpoints
    from dsv3.train.options import TrainOptions

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run.teardown_world = lambda world: None  # this process only: the group belongs to launch()
    summaries = []
    for spec in runs:
        out = Path(spec["options"]["out"])
        if rank == 0 and spec.get("copy_from"):
            shutil.copytree(spec["copy_from"], out, symlinks=True)
            for step, folder in complete_checkpoints(out):
                if step > spec["drop_after"]:
                    shutil.rmtree(folder)
        dist.barrier()
        opts = TrainOptions(**spec["options"])
        summaries.append(run.run_training(opts, resume=spec.get("resume", False), show_progress=False, plots=False))
        dist.barrier()
    return summaries
