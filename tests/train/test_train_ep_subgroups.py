"""`torchrun --nproc-per-node 4 -m dsv3 train --ep 2 --gpus-per-node 1`: the routed experts split over two
EP groups of two ranks (each group two "nodes" of one) and replicated across the groups, everything else
data parallel over all four. It trains like one process (fp32 wire formats) and checkpoints one sharded
(DCP) checkpoint, exported to the HF layout at the end (this once failed: --ep had to equal the number of
processes). Resuming is test_train_ep.py's and test_train_reshard.py's, the same code; one launch keeps the
test short."""

from __future__ import annotations

import os

import dsv3
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def test_ep_over_part_of_the_processes_trains_like_one_process(make_opts, train_argv, torchrun, tmp_path,
                                                               same_training_as):
    single = make_opts("single", steps=4, save_every=2, eval_every=2, warmup=0, min_lr_ratio=1.0)
    run_training(single, show_progress=False, plots=False)

    out = tmp_path / "ep2of4"
    summary = torchrun(4, train_argv(
        out, "--steps", "4", "--lr", str(single.lr), "--warmup", "0", "--min-lr-ratio", "1.0",
        "--save-every", "2", "--eval-every", "2", "--ep", "2", "--gpus-per-node", "1",
    ))
    assert summary["world_size"] == 4 and summary["step"] == 4
    assert summary["parameters"] == sum(p.numel() for p in dsv3.load_pretrained(single.out + "/latest").parameters())
    assert os.path.exists(out / "checkpoints" / "step-000004" / "dcp" / ".metadata")

    assert [r["step"] for r in read_rows(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    same_training_as(single.out, out)
