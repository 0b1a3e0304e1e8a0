"""`dsv3 train` from the command line: one JSON object on stdout, metrics rows, plots, a sample, and
one clear error line for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dsv3.cli import main

ROW_KEYS = {"step", "loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s", "expert_imbalance"}


def test_train_json_summary_metrics_plots_and_sample(train_argv, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        train_argv(
            out,
            "--steps",
            "8",
            "--eval-every",
            "4",
            "--save-every",
            "4",
            "--sample-tokens",
            "8",
            "--log-every",
            "2",
            "--json",
        )
    )
    captured = capsys.readouterr()
    assert code == 0
    summary = json.loads(captured.out)  # exactly one JSON object on stdout
    assert summary["step"] == 8 and summary["stopped"] == "completed"
    assert summary["final_loss"] < summary["first_loss"]
    assert 0 < summary["val_bpb"] < 8 and summary["tokens"] == 8 * 4 * 32
    assert summary["sample"].startswith("def") and len(summary["sample"]) > 3
    assert "step 8/8" in captured.err and "bits/byte" in captured.err

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 9)) and [r["step"] for r in evals] == [4, 8]
    assert all(ROW_KEYS <= set(r) for r in train)
    assert all(len(r["expert_imbalance"]) == 2 and min(r["expert_imbalance"]) >= 1.0 for r in train)
    # 8 experts, top-2, 4 x 32 tokens per step (main layer) + 4 x 31 (the MTP layer's MoE)
    assert [sum(layer) for layer in train[0]["expert_load"]] == [2 * 4 * 32, 2 * 4 * 31]
    lrs = [r["lr"] for r in train]  # warmup is min(100, 8 // 10) = 0 steps: cosine from the peak
    assert lrs[0] == pytest.approx(2e-3) and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[1]
    assert evals[-1]["val_bpb"] == pytest.approx(summary["val_bpb"])
    for png in ("loss_curve.png", "expert_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "run.json").read_text())["steps"] == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--precision", "fp16"], "--precision must be one of"),
        (["--batch-size", "3", "--grad-accum", "2"], "multiple of --grad-accum"),
        (["--seq-len", "4096"], "exceeds the model's max_position_embeddings"),
        (["--moe-output-format", "fp4"], "--moe-output-format must be one of"),
        (["--ep", "3"], "--ep 3 must divide the number of data-parallel processes (1)"),
        (["--data", "/nonexistent/corpus"], "no such file or folder"),
    ],
)
def test_bad_input_is_one_error_line_and_leaves_nothing_behind(train_argv, tmp_path, capsys, extra, message):
    """A refused start writes no run folder (a folder with only run.json made `dsv3 generate` advise
    --resume), and never touches a folder the user already had."""
    code = main(train_argv(tmp_path / "bad", "--steps", "2", *extra))
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
    mine = tmp_path / "mine"
    (mine / "notes.txt").parent.mkdir()
    (mine / "notes.txt").write_text("the user's\n")
    assert main(train_argv(mine, "--steps", "2", *extra)) == 2
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "the user's\n"


def test_missing_data_and_missing_resume_folder(tmp_path, capsys):
    assert (
        main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"), "--steps", "1"]) == 2
    )
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a training run folder" in capsys.readouterr().err
    assert not Path(tmp_path / "nothing").exists()


# ---- interrupted runs: re-running must always work, and the user is told where the checkpoint is ----

REPO = Path(__file__).resolve().parents[2]


def _wait_for_rows(path: Path, proc: subprocess.Popen, rows: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and sum(1 for _ in path.open()) >= rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("training did not reach the expected step in time")


def test_quickstart_after_ctrl_c_says_where_the_checkpoint_is_and_again_resumes_from_it(train_argv, tmp_path):
    """The real script on the tiny model: Ctrl-C (SIGINT to the whole process group, as a terminal sends
    it) before any evaluation used to crash the summary on a null val_loss; now the script names the
    checkpoint, says how to continue, skips the sample and exits 130. Run again, it says that it resumes
    and from which step (it used to announce a fresh `dsv3 train --preset nano`), and ends with a sample."""
    run = tmp_path / "q"
    extra = train_argv(run, "--eval-every", "1000", "--save-every", "1000", "--log-every", "1")
    extra = extra[1:extra.index("--out")] + extra[extra.index("--out") + 2:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUN": str(run), "EXTRA_TRAIN_ARGS": " ".join(extra),
           "STEPS": "100000"}
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "quickstart.sh")], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_rows(run / "metrics.jsonl", proc, 2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    step = json.loads((tmp_path / "q.summary.json").read_text())["step"]
    assert f"stopped at step {step} of 100000 (signal)" in err
    assert f"last checkpoint {run}/checkpoints/step-{step:06d}" in err and "quickstart.sh again" in err
    assert out == "" and "sample from" not in err

    again = subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh")], env={**env, "STEPS": str(step + 1)},
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    announced = again.stderr.splitlines()[0]
    assert announced == f"== resuming {run} from step {step} to {step + 1}: dsv3 train --resume {run} --steps " \
        f"{step + 1}", again.stderr
    assert f"resumed from {run}/checkpoints/step-{step:06d} at step {step}" in again.stderr
    assert f"== sample from {run}/latest" in again.stderr and again.stdout.strip()


def test_a_run_stopped_before_its_first_checkpoint_resumes_afresh(train_argv, tmp_path, capsys, monkeypatch):
    """An early Ctrl-C (or a crash) before the first save leaves run.json and metrics rows but no
    checkpoint: --resume used to refuse ("holds no complete checkpoint"); it now starts the run afresh,
    without the stale rows. Resuming the finished run then still reports its held-out loss."""
    from dsv3.train.loop import StepRunner

    real_run = StepRunner.run

    def interrupted_at_step_3(self, state):
        if state.step == 3:
            raise KeyboardInterrupt
        return real_run(self, state)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(StepRunner, "run", interrupted_at_step_3)
        args = train_argv(out, "--steps", "100000", "--save-every", "100000", "--eval-every", "100000")
        assert main(args) == 130
    assert (out / "run.json").exists() and not (out / "checkpoints").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    capsys.readouterr()

    assert main(["train", "--resume", str(out), "--steps", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert "holds no complete checkpoint yet; starting the run afresh" in captured.err
    summary = json.loads(captured.out)
    assert summary["step"] == 3 and summary["stopped"] == "completed" and summary["val_loss"] is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]

    assert main(["train", "--resume", str(out), "--steps", "3", "--json"]) == 0  # nothing left to do
    again = json.loads(capsys.readouterr().out)
    assert again["step"] == 3 and again["val_loss"] == summary["val_loss"]


@pytest.mark.parametrize("save_every", [1000, 1])
def test_ctrl_c_that_interrupts_at_once_says_what_is_on_disk(train_argv, tmp_path, capsys, monkeypatch,
                                                              save_every):
    """A second Ctrl-C (or one before training began) raises KeyboardInterrupt mid-step: exit 130 with
    one line naming the last checkpoint, or saying there is none and that re-running starts afresh."""
    from dsv3.train.loop import StepRunner

    real_run = StepRunner.run

    def run_then_interrupt(self, state):
        if state.step == 2:
            raise KeyboardInterrupt
        return real_run(self, state)

    monkeypatch.setattr(StepRunner, "run", run_then_interrupt)
    out = tmp_path / "run"
    code = main(train_argv(out, "--steps", "5", "--save-every", str(save_every), "--eval-every", "1000"))
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    if save_every == 1:
        assert f"interrupted; last checkpoint {out}/checkpoints/step-000002; continue with" in err
    else:
        assert f"interrupted before the first checkpoint: {out} holds none" in err


def test_ctrl_c_before_the_run_began_writes_nothing_and_says_so(train_argv, tmp_path, capsys, monkeypatch):
    """Interrupted while the data is prepared, the run has claimed no folder yet: nothing to --resume."""
    import dsv3.train.run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dsv3.train.run, "prepare_data", interrupted)
    out = tmp_path / "run"
    assert main(train_argv(out, "--steps", "5")) == 130
    assert capsys.readouterr().err.strip() == f"interrupted before the run began; nothing was written to {out}"
    assert not out.exists()


def test_summary_message_of_a_stopped_run_without_evaluation():
    from dsv3.train.cli import summary_message

    summary = {"step": 7, "steps": 300, "tokens": 896, "tokens_per_s": None, "first_loss": 5.0,
               "final_loss": 4.5, "val_loss": None, "val_bpb": None, "stopped": "signal",
               "checkpoint": None, "run_dir": "runs/x"}
    text = summary_message(summary)
    assert "stopped at step 7 of 300 (signal)" in text and "no checkpoint was saved" in text
    assert "None" not in text and "held-out" not in text
