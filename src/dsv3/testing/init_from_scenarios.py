"""What each rank of `dsv3 train --init-from` reads of the checkpoint: the trainer's own model build
(`build_model`) on gloo processes, with the `CheckpointValues` it reads through."""

from __future__ import annotations

import torch

from dsv3.checkpoint import CheckpointValues, pretrained_config


def read_share_worker(rank: int, world: int, folder: str, layout: dict) -> dict:
    """Build the trainer's model of ``layout`` (TrainOptions fields) from ``folder``; what this rank read."""
    from dsv3.train.distributed import World
    from dsv3.train.options import TrainOptions
    from dsv3.train.run import build_model

    cfg = pretrained_config(folder)
    values = CheckpointValues(folder, cfg)
    build_model(cfg, TrainOptions(init_from=folder, **layout), World(rank, world, rank, torch.device("cpu")),
                init_from=values)
    return {"bytes_read": values.bytes_read, "total_bytes": values.total_bytes, "names_read": sorted(values.names_read)}
