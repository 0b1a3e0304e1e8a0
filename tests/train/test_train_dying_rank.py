"""`torchrun --nproc-per-node 4 -m dsv3 train --ep 4 --dp-shard fsdp` end to end (real processes), then the
same run resumed and one of its processes killed with SIGKILL mid-run: the others must stop with one clear
`error:` line each (no traceback) within a bounded time, not hang; `--dist-timeout` bounds a hung peer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.testing.launch import rank_pid, train_steps_done
from dsv3.train.distributed import World, is_peer_failure, lost_peer_message

KILL_BOUND_S = 120  # measured: the survivors stop about 8 s after the kill (2 loaded cores)
PACKAGE_DIR = str(Path(dsv3.__file__).parent) + os.sep  # src/dsv3/ of this checkout, whatever its folder


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "dsv3",
            *args]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
def test_fsdp_ep_under_torchrun_then_a_killed_rank_stops_the_others_with_one_error_line(train_argv, tmp_path):
    out = tmp_path / "fsdp-ep4"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(_torchrun([*train_argv(out, "--steps", "2", "--save-every", "2", "--ep", "4",
                                                  "--dp-shard", "fsdp", "--dist-timeout", "60"), "--json"]),
                           capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    full = dsv3.load_pretrained(out / "latest")  # one ordinary checkpoint with every expert
    assert summary["world_size"] == 4 and summary["parameters"] == sum(p.numel() for p in full.parameters())
    memory = json.loads((out / "run.json").read_text())["memory"]
    assert memory["layout"]["ep"] == 4 and memory["layout"]["dp_shard"] == "fsdp"
    assert [m["rank"] for m in memory["per_rank"]] == [0, 1, 2, 3]
    full_bytes = sum(p.numel() * 4 for p in full.parameters())
    for m in memory["per_rank"]:  # every parameter 1/4 per rank: the non-expert ones by FSDP, experts by EP
        assert m["parameters"] == pytest.approx(full_bytes / 4, rel=0.02) and m["optimizer"] > m["parameters"]

    proc = subprocess.Popen(_torchrun(["train", "--resume", str(out), "--steps", "1000", "--log-every", "1",
                                       "--save-every", "1000"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a failed test ends all of it
    try:
        deadline = time.monotonic() + 300
        while train_steps_done(out) < 4:  # two steps of the resumed run are done
            assert proc.poll() is None and time.monotonic() < deadline, "the resumed run did not get going"
            time.sleep(0.2)
        victim = rank_pid(out, 2)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=KILL_BOUND_S)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0 and took < KILL_BOUND_S
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors, stderr[-3000:]
    for line in errors:
        assert line.startswith(("error: rank 0 of 4 stopped", "error: rank 1 of 4 stopped",
                                "error: rank 3 of 4 stopped")), line
        assert "another process of the run died or did not answer within --dist-timeout 60 s" in line
        assert f"last checkpoint {out}/checkpoints/step-000002" in line  # the run's --dist-timeout was kept
        assert line.endswith(f"continue with: dsv3 launch --nproc 4 train --resume {out} --dp-shard fsdp --ep 4")
    # No traceback through dsv3's own code (torch's frames, e.g. under a clone's .venv, are not ours).
    frames = [line for line in stderr.splitlines() if line.lstrip().startswith("File ")]
    assert "RuntimeError" not in stderr and not [f for f in frames if PACKAGE_DIR in f], stderr[-3000:]


def test_a_peer_failure_is_recognised_and_named_in_one_line(tmp_path):
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] \nConnection closed by peer "
                        "[127.0.0.1]:18315. This is typically caused by a \nremote worker crashing.")
    assert is_peer_failure(gloo) and is_peer_failure(torch.distributed.DistError("x"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("connection closed by peer"))
    line = lost_peer_message(World(3, 4, 3, torch.device("cpu")), gloo, tmp_path, 600)
    assert line == ("rank 3 of 4 stopped: another process of the run died or did not answer within "
                    "--dist-timeout 600 s (Connection closed by peer [127.0.0.1]:18315); no checkpoint was saved")


def test_dist_timeout_must_be_positive(make_opts, train_argv, tmp_path, capsys):
    from dsv3.cli import main

    with pytest.raises(DSV3Error, match="--dist-timeout must be a positive number of seconds"):
        make_opts(dist_timeout=0).check()
    assert main(train_argv(tmp_path / "bad", "--dist-timeout", "-1")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --dist-timeout must be a positive number of seconds, got -1.0")


def test_groups_created_after_the_world_time_out_like_it():
    """The hung-rank case once waited 30 minutes despite --dist-timeout 10: the EP, replica and mesh groups
    (`new_group` without a timeout) took torch's module default instead of the world's timeout."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from dsv3.train.distributed import _groups_time_out_after

    saved = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    try:
        _groups_time_out_after(timedelta(seconds=7))
        assert distributed_c10d._get_default_timeout("gloo") == timedelta(seconds=7)
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = saved
