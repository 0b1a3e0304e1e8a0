"""`run_training` on the processes of `dsv3.testing.launch` (a gloo group already joined): what
``torchrun -m dsv3 train`` does on each rank, without starting a fresh interpreter per rank and run, which
keeps the sharded-training tests fast."""

from __future__ import annotations

import os

import torch.distributed as dist


def train_worker(rank: int, world: int, options: dict, resume: bool) -> dict:
    """Train ``TrainOptions(**options)`` as rank ``rank`` of ``world``; returns the run's summary. The
    group belongs to the launcher, so the run must not tear it down (it would, under torchrun)."""
    from dsv3.train import run
    from dsv3.train.options import TrainOptions

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run.teardown_world = lambda world: None  # this process only: launch() destroys the group itself
    summary = run.run_training(TrainOptions(**options), resume=resume, show_progress=False, plots=False)
    dist.barrier()
    return summary
