"""Several processes with real launchers (gloo, 2 processes, the tiny model): bad input is one `error:` line
for the whole run, under torchrun and `dsv3 launch`; `dsv3 launch` shows only dsv3's lines and status, and
Ctrl-C of a run it started ends with the stop message and a resume command that works as printed."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from dsv3.errors import DSV3Error, report
from dsv3.launch import failed_status
from dsv3.testing.launch import train_steps_done
from dsv3.train.options import TrainOptions, resume_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# What torch's launcher adds of its own: its log lines (W1202 12:02:39.269000 ...), tracebacks, reports.
TORCH_NOISE = re.compile(r"^[DIWEF]\d{4} |Traceback|SignalException|ChildFailedError", re.M)


def _dsv3(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv3", *args], capture_output=True, text=True, env=ENV,
                          timeout=300, **kwargs)


def test_a_refused_start_is_one_error_line_under_torchrun_and_only_that_under_dsv3_launch(train_argv, tmp_path):
    """Every process meets the same bad flag; rank 0 alone says so (it was once per process), and nothing
    is left on disk. torchrun then adds its own report; `dsv3 launch` adds nothing and exits 2."""
    out = tmp_path / "refused"
    message = "error: --ep 3 must divide the number of data-parallel processes (2)"
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", "-m", "dsv3", *train_argv(out, "--steps", "2", "--ep", "3")],
                              capture_output=True, text=True, env=ENV, timeout=300)
    errors = [line for line in torchrun.stderr.splitlines() if line.startswith("error: ")]
    assert torchrun.returncode != 0 and len(errors) == 1 and errors[0].startswith(message), torchrun.stderr
    assert not out.exists()

    launched = _dsv3("launch", "--nproc", "2", *train_argv(out, "--steps", "2", "--ep", "3"))
    assert launched.returncode == 2 and launched.stderr.splitlines() == [errors[0]], launched.stderr
    assert not out.exists()

    serve = _dsv3("launch", "--nproc", "2", "serve", "--model", str(tmp_path / "none"), "--ep", "2")
    assert serve.returncode == 2 and serve.stderr.splitlines() == [
        f"error: model folder not found: {tmp_path / 'none'}"], serve.stderr


def test_launch_refuses_what_it_cannot_start():
    assert _dsv3("launch", "--nproc", "0", "train").stderr == "error: --nproc must be at least 1, got 0\n"
    wrong = _dsv3("launch", "--nproc", "2", "torchrun")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: dsv3 launch runs a dsv3 command (train, ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a process group")
def test_ctrl_c_under_dsv3_launch_stops_cleanly_and_the_printed_resume_command_works(train_argv, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it; torch's workers are out of its reach)
    reaches every process once: the run checkpoints and exits 0 with the stop message, and no traceback
    (torchrun ends such a run with its SignalException). The printed command, run as printed (with
    --steps to end it soon), continues the run with its layout on as many processes."""
    out = tmp_path / "run"
    args = train_argv(out, "--steps", "100000", "--save-every", "1000", "--eval-every", "1000", "--log-every",
                      "1", "--ep", "2")
    proc = subprocess.Popen([sys.executable, "-m", "dsv3", "launch", "--nproc", "2", *args], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_until(lambda: train_steps_done(out) >= 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0 and not TORCH_NOISE.search(stderr) and "error" not in stderr, stderr
    stopped = re.search(r"== stopped at step (\d+) of 100000 \(signal\)", stderr)
    assert stopped, stderr
    step = int(stopped[1])
    hint = stderr.rstrip().splitlines()[-1]
    assert hint == (f"== last checkpoint {out}/checkpoints/step-{step:06d}; "
                    f"continue with: dsv3 launch --nproc 2 train --resume {out} --ep 2"), stderr

    printed = shlex.split(hint.split("continue with: ")[1])
    assert printed[0] == "dsv3"
    resumed = _dsv3(*printed[1:], "--steps", str(step + 1), "--json")
    assert resumed.returncode == 0 and not TORCH_NOISE.search(resumed.stderr), resumed.stderr
    assert f"resumed from {out}/checkpoints/step-{step:06d} at step {step}" in resumed.stderr
    summary = json.loads(resumed.stdout)  # rank 0's alone
    assert summary["step"] == step + 1 and summary["world_size"] == 2 and summary["stopped"] == "completed"


def _wait_until(done, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.05)


def test_the_resume_command_names_the_launcher_and_the_layout(make_opts, tmp_path, monkeypatch):
    """One process: plain `dsv3 train`; several on one machine: `dsv3 launch`; several machines: torchrun's
    line per node. The layout flags the run had come along; a folder without run.json gets none."""
    opts = make_opts(ep=2, dp_shard="zero1")
    opts.save(tmp_path / "run" / "run.json")
    run = tmp_path / "run"
    assert TrainOptions.load(run).ep == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resume_command(run, 1) == f"dsv3 train --resume {run} --dp-shard zero1 --ep 2"
    assert resume_command(run, 4) == f"dsv3 launch --nproc 4 train --resume {run} --dp-shard zero1 --ep 2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(run, 4) == ("torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:PORT -m dsv3 "
                                      f"train --resume {run} --dp-shard zero1 --ep 2")
    assert resume_command(tmp_path / "my run", 1) == f"dsv3 train --resume '{tmp_path / 'my run'}'"


def _failure(tmp_path, rank: int, exitcode: int, error: DSV3Error | None, monkeypatch):
    """torch's record of a failed process, with the reply file `report` left when it met ``error``."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    reply = tmp_path / f"{rank}" / "error.json"
    reply.parent.mkdir()
    if error is not None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(reply))
        report(error)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(reply))


@pytest.mark.parametrize("case", ["rank 0 said it", "rank 0 was stopped first", "a rank was killed"])
def test_the_launcher_says_what_failed_once(case, tmp_path, monkeypatch, capsys):
    """Rank 0 prints the run's error line and the other ranks leave it in torch's reply file: the launcher
    adds nothing when rank 0 said it, says the line itself when rank 0 was stopped before it could, and
    names a process that crashed or was killed (it left no line) with its status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    bad = DSV3Error("--ep 3 must divide the number of data-parallel processes (2)")
    first, second = {
        "rank 0 said it": ((0, 2, bad), (1, 2, bad)),
        "rank 0 was stopped first": ((1, 2, bad), (0, -signal.SIGTERM, None)),
        "a rank was killed": ((1, -signal.SIGKILL, None), (0, -signal.SIGTERM, None)),
    }[case]
    failures = {rank: _failure(tmp_path, rank, code, error, monkeypatch) for rank, code, error in (first, second)}
    printed = capsys.readouterr().err  # what the ranks' report() printed
    assert printed == ("error: --ep 3 must divide the number of data-parallel processes (2)\n"
                       if case == "rank 0 said it" else "")
    failures[first[0]].timestamp -= 1  # the first to fail
    status = failed_status(ChildFailedError("dsv3", failures))
    said = capsys.readouterr().err
    if case == "a rank was killed":
        assert status == 137 and said == "error: the process of rank 1 was killed by SIGKILL; the run stopped\n"
    else:
        assert status == 2 and said == ("" if case == "rank 0 said it" else f"error: {bad}\n")
