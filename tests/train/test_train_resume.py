"""Interrupt (SIGTERM) and resume: the per-step losses equal an uninterrupted run bit for bit (CPU, fp32);
checkpoints are sharded (DCP) folders that load_pretrained reads, the last one of a run also its HF export
(transformers loads it, MTP layer included), and `dsv3 convert --to hf` exports any of them; the last K are
kept; a resume cannot silently change the run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.train.checkpoints import complete_checkpoints
from dsv3.train.metrics import read_rows
from dsv3.train.run import run_training


def _train_rows(run_dir):
    return [r for r in read_rows(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"]


def test_sigterm_then_resume_matches_uninterrupted_bit_for_bit(make_opts):
    full_opts = make_opts("full", steps=7, save_every=100, eval_every=100, keep_last=2)
    full = run_training(full_opts, show_progress=False, plots=False)
    assert full["stopped"] == "completed" and full["step"] == 7

    def sigterm_at_step_3(row):
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler asks for a stop after this step

    cut_opts = make_opts("cut", steps=7, save_every=100, eval_every=100, keep_last=2)
    cut = run_training(cut_opts, on_step=sigterm_at_step_3, show_progress=False, plots=False)
    assert cut["stopped"] == "signal" and cut["step"] == 3
    assert [s for s, _ in complete_checkpoints(cut_opts.out)] == [
        3
    ]  # stop => checkpoint, whatever save_every

    resumed = run_training(make_opts("cut", steps=7), resume=True, show_progress=False, plots=False)
    assert resumed["stopped"] == "completed" and resumed["step"] == 7

    a, b = _train_rows(full_opts.out), _train_rows(cut_opts.out)
    assert [r["step"] for r in b] == list(range(1, 8))
    for key in ("loss", "total_loss", "mtp_loss", "balance_loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert [r["expert_load"] for r in a] == [r["expert_load"] for r in b]
    assert a[-1]["loss"] < a[0]["loss"]

    ma = dsv3.load_pretrained(full_opts.out + "/latest")
    mb = dsv3.load_pretrained(cut_opts.out + "/latest")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_checkpoints_are_sharded_the_last_one_also_hf_and_last_k_are_kept(make_opts):
    opts = make_opts(steps=6, save_every=2, keep_last=2)
    summary = run_training(opts, show_progress=False, plots=False)
    assert [s for s, _ in complete_checkpoints(opts.out)] == [4, 6]
    latest = summary["checkpoint"]
    assert latest.endswith("step-000006") and os.path.realpath(opts.out + "/latest") == latest
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "trainer_state.pt", "trainer_state.json",
                 "dcp/.metadata", "dcp/__0_0.distcp"):
        assert os.path.exists(os.path.join(latest, name)), name
    assert os.path.exists(os.path.join(latest, "model.safetensors"))  # the run's end: the HF export
    middle = Path(opts.out) / "checkpoints" / "step-000004"
    assert not (middle / "model.safetensors").exists()  # only the sharded state: no gather during the run
    from_dcp = dsv3.load_pretrained(middle)  # ... which load_pretrained reads all the same
    assert from_dcp.config.num_nextn_predict_layers == 1 and not any(t.is_meta for t in from_dcp.state_dict().values())
    model = dsv3.load_pretrained(latest)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 16, model.config.vocab_size) and torch.isfinite(logits).all()
    # trained, so far from the uniform distribution's loss ln(V)
    labels = ids.roll(-1, 1)
    assert model.loss(ids, labels).lm_loss < torch.log(torch.tensor(320.0))


def test_resume_refuses_a_changed_defining_option_and_a_fresh_run_refuses_an_existing_folder(make_opts):
    opts = make_opts(steps=2, save_every=2)
    run_training(opts, show_progress=False, plots=False)
    from dsv3.train.cli import _options

    with pytest.raises(DSV3Error, match="--lr"):
        _options({"lr": 1.0}, opts.out)
    with pytest.raises(DSV3Error, match="already holds a run"):
        run_training(make_opts(steps=2), show_progress=False, plots=False)
    longer = _options({"steps": 4}, opts.out)  # the total may grow
    assert longer.steps == 4 and longer.lr == opts.lr
    assert run_training(longer, resume=True, show_progress=False, plots=False)["step"] == 4
    import shutil

    shutil.rmtree(Path(opts.out) / "latest" / "dcp")  # what an earlier dsv3's checkpoint lacks
    saved = (Path(opts.out) / "run.json").read_text()
    with pytest.raises(DSV3Error, match="written by an older dsv3 whose training checkpoints cannot be resumed"):
        run_training(_options({"steps": 6}, opts.out), resume=True, show_progress=False, plots=False)
    assert (Path(opts.out) / "run.json").read_text() == saved  # a refused resumption rewrites nothing


def test_the_export_loads_in_transformers_and_convert_exports_any_checkpoint(make_opts, tmp_path,
                                                                             tiny_train_config):
    """The run's HF export gives the trained model's logits in transformers, and holds the MTP layer as
    trained; `dsv3 convert CKPT DST --to hf` exports a mid-run (sharded only) checkpoint the same way."""
    import transformers

    from dsv3.cli import main
    from dsv3.parallel.checkpoint import whole_model

    config = tmp_path / "config.json"  # transformers repeats KV heads: as many as the query heads
    tiny_train_config.replace(num_key_value_heads=tiny_train_config.num_attention_heads).save_json(config)
    opts = make_opts("export", steps=4, save_every=2, config=str(config))
    run_training(opts, show_progress=False, plots=False)
    latest = Path(opts.out) / "latest"
    trained = whole_model(latest / "dcp", dsv3.load_pretrained(latest).config).eval()
    exported = dsv3.load_pretrained(latest)  # from model.safetensors
    for (name, a), b in zip(trained.state_dict().items(), exported.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # MTP layer (model.layers.2.*) included
    assert any(n.startswith("model.layers.2.") for n in exported.state_dict())
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(latest, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trained(ids), rtol=1e-4, atol=1e-4)

    middle, dst = Path(opts.out) / "checkpoints" / "step-000002", tmp_path / "hf"
    assert main(["convert", str(middle), str(dst), "--to", "hf", "--json"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    again = dsv3.load_pretrained(dst)
    for (name, a), b in zip(dsv3.load_pretrained(middle).state_dict().items(), again.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert main(["convert", str(middle), str(tmp_path / "fp8"), "--to", "fp8"]) == 0  # straight to FP8 blocks
    assert dsv3.load_pretrained(tmp_path / "fp8").config.quantization_config["fmt"] == "e4m3"
