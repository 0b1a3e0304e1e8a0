"""The LogFMT training experiment and the MoE-output capture: their plumbing on a tiny model, a few steps.

What must hold whatever the numbers: every format trains, results are keyed per format and seed, the
combine format really changes the forward pass, and the captured tensors are the routed experts' outputs.
"""

import json
import math
import random

import pytest
import torch

from dsv3.studies import logfmt_study

WORDS = "def class return import value for in range if else lambda yield print self the a of".split()


@pytest.fixture(scope="module")
def settings(tmp_path_factory, tiny_train_config) -> dict:
    """Training settings of a 2-layer, 8-expert model on a 12-document corpus: a run is ~1 s."""
    root = tmp_path_factory.mktemp("logfmt-train")
    config = root / "config.json"
    tiny_train_config.save_json(config)
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(12):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(30))
        (corpus / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return {
        "preset": "nano",
        "config": str(config),
        "data": [str(corpus)],
        "steps": 2,
        "batch_size": 2,
        "seq_len": 32,
        "lr": 3e-3,
        "eval_tokens": 64,
        "threads": 1,
        "cache_dir": str(root / "cache"),
    }


def test_the_combine_hook_changes_the_forward_pass_by_the_formats_error(tiny_train_config):
    from dsv3.model.transformer import Transformer
    from dsv3.train.precision import apply_moe_output_format

    cfg = tiny_train_config
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = Transformer(cfg).eval()
    with torch.no_grad():
        exact = reference(ids)
    change = {}
    for fmt in ("bf16", "e4m3", "e5m2", "logfmt8", "logfmt10"):
        model = Transformer(cfg).eval()
        model.load_state_dict(reference.state_dict())
        assert apply_moe_output_format(model, fmt) == 2  # layer 1 and the MTP module (layer 0 is dense)
        with torch.no_grad():
            change[fmt] = (model(ids) - exact).norm().item() / exact.norm().item()
    assert all(c > 0 for c in change.values()), change
    assert change["bf16"] < change["logfmt10"] < change["logfmt8"] < change["e5m2"], change
    assert change["logfmt8"] < change["e4m3"], change


def test_every_format_trains_and_results_are_keyed_per_format_and_seed(settings):
    formats, seeds = list(logfmt_study.TRAIN_FORMATS), [0, 1]
    result = logfmt_study.run_training_study(formats, seeds, settings)
    runs = {(r["format"], r["seed"]): r for r in result["runs"]}
    assert set(runs) == {(f, s) for f in formats for s in seeds} and len(result["runs"]) == 12
    for run in result["runs"]:
        assert run["skipped_steps"] == 0 and math.isfinite(run["val_loss"])
        assert run["tokens"] == settings["steps"] * settings["batch_size"] * settings["seq_len"]
    # same seed, same init and data: only the combine's rounding can move the losses. On this 32-wide model
    # the MoE output is small beside the residual stream, so bf16's rounding of it moves a loss by about the
    # fp32 resolution of the loss (1e-6) and may leave one seed's numbers unchanged: each format must move
    # some loss of some seed.
    numbers = {key: (r["first_loss"], r["final_loss"], r["val_loss"]) for key, r in runs.items()}
    for fmt in formats[1:]:
        assert any(numbers[fmt, seed] != numbers["fp32", seed] for seed in seeds), fmt
    assert runs["fp32", 0]["first_loss"] != runs["fp32", 1]["first_loss"]  # the seed is applied
    summary = result["summary"]
    assert list(summary) == formats
    for fmt in formats:
        cell = summary[fmt]
        losses = [runs[fmt, s]["val_loss"] for s in seeds]
        assert cell["val_loss_per_seed"] == {"0": losses[0], "1": losses[1]}
        assert cell["val_loss_mean"] == pytest.approx(sum(losses) / 2)
        assert cell["val_loss_std"] == pytest.approx(abs(losses[0] - losses[1]) / 2**0.5)
        deltas = [runs[fmt, s]["val_loss"] - runs["bf16", s]["val_loss"] for s in seeds]
        assert cell["delta_vs_bf16_mean"] == pytest.approx(sum(deltas) / 2)
    assert summary["bf16"]["delta_vs_bf16_mean"] == 0 and summary["bf16"]["delta_vs_bf16_std"] == 0
    table = logfmt_study.train_markdown(result)
    assert table.count("\n") == 1 + len(formats) and "| logfmt8 |" in table


def test_same_seed_and_format_reproduce_exactly(settings):
    first = logfmt_study.train_one("logfmt8", 3, settings)
    again = logfmt_study.train_one("logfmt8", 3, settings)
    assert first["val_loss"] == again["val_loss"] and first["final_loss"] == again["final_loss"]


def run_cli(args, capsys):
    from dsv3.cli import main

    code = main(["study", "logfmt", *args])
    return code, capsys.readouterr()


def test_train_cli_prints_one_json_object_and_a_plot(settings, capsys, tmp_path):
    plot = tmp_path / "train.png"
    args = ["--train", "--config", settings["config"], "--data", settings["data"][0], "--steps", "1"]
    args += ["--batch-size", "2", "--seq-len", "32", "--eval-tokens", "64", "--seeds", "0,1"]
    args += ["--formats", "bf16,logfmt10", "--cache-dir", settings["cache_dir"], "--json", "--plot", str(plot)]
    code, out = run_cli(args, capsys)
    assert code == 0, out.err
    result = json.loads(out.out)
    assert result["study"] == "logfmt-train" and list(result["summary"]) == ["bf16", "logfmt10"]
    assert len(result["runs"]) == 4 and result["config"]["seeds"] == [0, 1]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train", "--formats", "bf16,fp64"], "unknown fp64"),
        (["--train", "--seeds", "0,0"], "twice"),
        (["--train", "--seeds", "a"], "comma-separated"),
        (["--train", "--steps", "0"], "--steps"),
        (["--capture-from", "/nonexistent/ckpt"], "not a checkpoint folder"),
    ],
)
def test_bad_training_or_capture_input_is_one_clear_error(args, message, capsys):
    code, out = run_cli(args, capsys)
    assert code == 2 and message in out.err and out.out == ""


def test_capture_keeps_each_moe_layers_routed_output(settings, tmp_path):
    from dsv3.train.run import run_training

    opts = logfmt_study.training_options("fp32", 0, settings, tmp_path / "run")
    run_training(opts, show_progress=False, plots=False)
    checkpoint = tmp_path / "run" / "latest"
    data, share = logfmt_study.capture_moe_outputs(checkpoint, batches=2, seq_len=24)
    assert list(data) == ["moe-out:layer 1"] and list(share) == ["moe-out:layer 1"]
    captured = data["moe-out:layer 1"]
    assert captured.shape == (48, 32) and captured.dtype == torch.float32
    assert captured.abs().sum(-1).gt(0).all()  # every token went to its experts
    assert 0 < share["moe-out:layer 1"] < 10
    result = logfmt_study.run_study(data, {})
    rmse = {r["format"]: r["rel_rmse"] for r in result["rows"]}
    assert rmse["bf16"] < rmse["logfmt10"] < rmse["logfmt8"] < rmse["e4m3"] < rmse["e5m2"]
