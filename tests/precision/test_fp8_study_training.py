"""`dsv3 study fp8 --train` and `--capture-from`: the plumbing on a tiny config, corpus and checkpoint
(the real numbers come from the nano preset; see docs/fp8.md)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv3.cli import main as cli_main
from dsv3.config import preset
from dsv3.studies import fp8_capture
from dsv3.studies.fp8_training import compare_training, training_markdown, write_training_plot

WORDS = "the quick brown fox jumps over a lazy dog def class return import print value for in".split()


@pytest.fixture
def tiny_options(tmp_path):
    cfg = preset("nano").replace(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=128,
    )
    cfg.save_json(tmp_path / "config.json")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10))
                                                          for _ in range(30)))
    return dict(config=str(tmp_path / "config.json"), data=[str(corpus)], cache_dir=str(tmp_path / "cache"),
                device="cpu", val_fraction=0.2, steps=4, batch_size=4, seq_len=32, lr=3e-3, eval_every=2,
                eval_tokens=128, log_every=2)


def test_compare_training_runs_every_variant_per_seed_and_reports_gaps(tiny_options, tmp_path):
    result = compare_training([0, 1], tmp_path / "runs", **tiny_options)
    assert [(r["seed"], r["variant"]) for r in result["runs"]] == [
        (s, v) for s in (0, 1) for v in ("bf16", "fp8-fine", "fp8-tensor")
    ]
    summary = result["summary"]
    assert summary["bf16"]["rel_gap_to_bf16"] == [0.0, 0.0]
    for variant in ("fp8-fine", "fp8-tensor"):
        losses, gaps = summary[variant]["val_loss"], summary[variant]["rel_gap_to_bf16"]
        want = [(x - b) / b for x, b in zip(losses, summary["bf16"]["val_loss"], strict=True)]
        assert gaps == pytest.approx(want)
        assert all(0 < abs(g) < 0.05 for g in gaps)  # FP8 changes the numbers, but only a little
    # same seed, same data: the first training loss of each variant differs only by FP8 rounding
    firsts = [r["train_curve"][0][1] for r in result["runs"] if r["seed"] == 0]
    assert max(firsts) - min(firsts) < 0.05 * firsts[0]
    seed0, seed1 = (next(r for r in result["runs"] if r["seed"] == s and r["variant"] == "bf16") for s in (0, 1))
    assert seed0["val_loss"] != seed1["val_loss"] and result["bf16_seed_spread"] > 0
    assert [step for step, _ in seed0["val_curve"]] == [2, 4]
    # the per-tensor runs really ran per-tensor FP8: they differ from the fine-grained ones
    assert summary["fp8-tensor"]["val_loss"] != summary["fp8-fine"]["val_loss"]
    table = training_markdown(result)
    assert "| fp8-fine |" in table and "Run-to-run spread" in table
    write_training_plot(result, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_capture_records_linear_inputs_of_the_chosen_layers():
    cfg = preset("nano").replace(vocab_size=256, num_hidden_layers=3, n_routed_experts=8, n_group=2)
    from dsv3.model import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    captured = fp8_capture.capture_inputs(model, torch.randint(0, 256, (2, 16)), [0, 2])
    assert set(captured) == {
        "L0.self_attn.q_proj", "L0.self_attn.kv_b_proj", "L0.self_attn.o_proj", "L0.mlp.down_proj",
        "L2.self_attn.q_proj", "L2.self_attn.kv_b_proj", "L2.self_attn.o_proj", "L2.mlp.experts",
        "L2.mlp.shared_experts.down_proj",
    }
    assert captured["L0.mlp.down_proj"].shape == (32, cfg.intermediate_size)
    assert captured["L2.mlp.experts"].shape == (32, cfg.hidden_size)
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed afterwards


def test_real_activation_rows_zero_natural_outliers_and_add_artificial_ones():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x[:, 3] *= 500.0  # one natural outlier channel
    rows = fp8_capture.real_activation_rows({"t": x}, seed=0)
    names = [r["tensor"] for r in rows]
    assert names == ["t", "t, its 1 outlier channels zeroed", "t, 2 channels x1000", "t, 2 channels x10000"]
    assert rows[0]["outlier_channels"] == 1 and rows[1]["outlier_channels"] == 0
    spiked = rows[3]["schemes"]
    # 10^4 x outliers push per-tensor-scaled ordinary values into E4M3 subnormals; 1x128 tiles limit that
    assert spiked["per-tensor"]["flushed_to_zero"] > 2 * spiked["1x128"]["flushed_to_zero"]
    assert spiked["per-tensor"]["median_channel_rel_rmse"] > 1.2 * spiked["1x128"]["median_channel_rel_rmse"]


def test_cli_train_rejects_bad_seeds(capsys):
    assert cli_main(["study", "fp8", "--train", "--seeds", "0,x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert cli_main(["study", "fp8", "--train", "--seeds", "1,1"]) == 2


def test_cli_capture_from_a_folder_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["study", "fp8", "--capture-from", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert "tokenizer.json" in captured.err and captured.out == ""
