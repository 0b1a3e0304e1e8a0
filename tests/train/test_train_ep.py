"""`torchrun --nproc-per-node 4 -m dsv3 train --ep 4 --gpus-per-node 2`: experts sharded over four gloo
processes (2 nodes x 2, one expert group per node) train like one process (fp32 wire formats),
checkpoint each rank's experts into one sharded (DCP) checkpoint, and resume from it."""

from __future__ import annotations

import os

from dsv3.train.run import run_training


def test_expert_parallel_run_and_resume_match_one_process(make_opts, train_argv, torchrun, tmp_path,
                                                           same_training_as):
    # a constant learning rate, so that a 2-step run resumed to 4 steps follows the 4-step schedule
    single = make_opts("single", steps=4, save_every=2, eval_every=2, warmup=0, min_lr_ratio=1.0)
    run_training(single, show_progress=False, plots=False)

    out = tmp_path / "ep"
    first = torchrun(4, train_argv(
        out, "--steps", "2", "--lr", str(single.lr), "--warmup", "0", "--min-lr-ratio", "1.0",
        "--save-every", "2", "--eval-every", "2", "--ep", "4", "--gpus-per-node", "2",
    ))
    assert first["world_size"] == 4 and first["parameters"] == single_parameters(single)
    assert os.path.exists(out / "checkpoints" / "step-000002" / "dcp" / "__3_0.distcp")  # rank 3 wrote its experts
    second = torchrun(4, ["train", "--resume", str(out), "--steps", "4"])
    assert second["step"] == 4

    same_training_as(single.out, out)


def single_parameters(opts) -> int:
    from dsv3.config import load_config
    from dsv3.model import Transformer

    return sum(p.numel() for p in Transformer(load_config(opts.config)).parameters())
