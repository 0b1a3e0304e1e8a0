"""`dsv3 train --init-from DIR`: fine-tuning a DeepSeek-format checkpoint written by transformers (V3, V2).
The trainer builds the model on ``meta``, lays it out, then each rank reads only the tensors, experts and
FSDP rows it holds: the first step's loss is transformers' loss on the same tokens, and the steps under
pp2 x ep2 (4 processes) and ep2 x fsdp (2 processes) are the one process's. Bad input is one error line
and exit status 2, before the run folder exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dsv3.checkpoint import CheckpointValues, pretrained_config
from dsv3.config import ModelConfig
from dsv3.train.distributed import World
from dsv3.train.options import TrainOptions
from dsv3.train.run import build_model

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=128, rope_scaling=None, torch_dtype="float32")
KINDS = {
    "v3": dict(q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1),
    "v2": dict(model_type="deepseek_v2", q_lora_rank=None, scoring_func="softmax", topk_method="group_limited_greedy",
               n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, num_nextn_predict_layers=0),
}
CONSTANT_LR = ("--warmup", "0", "--min-lr-ratio", "1.0")


def write_hf_checkpoint(folder: Path, kind: str = "v3", **changes) -> Path:
    """A tiny DeepseekV3/V2ForCausalLM with random weights (norms and the router bias too), saved by
    transformers (fp32, no MTP layer: transformers drops it)."""
    cfg = ModelConfig(**{**BASE, **KINDS[kind], **changes}).validate()
    cls = transformers.DeepseekV2ForCausalLM if kind == "v2" else transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    hf = cls(cls.config_class.from_dict(cfg.to_dict(rope_layout="new")))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                scale, shift = (0.1, 1.0) if "norm" in name else (0.05, 0.0) if "bias" in name else (0.08, 0.0)
                t.copy_(shift + scale * torch.randn(t.shape, generator=gen))
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: write_hf_checkpoint(root / kind, kind) for kind in KINDS}


@pytest.mark.parametrize("kind", list(KINDS))
def test_first_step_loss_is_transformers_loss_on_the_same_tokens(kind, checkpoints):
    folder = checkpoints[kind]
    cfg = pretrained_config(folder)
    parallel = build_model(cfg, TrainOptions(init_from=str(folder)), World(0, 1, 0, torch.device("cpu")),
                           init_from=CheckpointValues(folder, cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    _, parts = parallel(ids[:, :-1], ids[:, 1:])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = float(hf(input_ids=ids, labels=ids).loss)
    assert float(parts[1]) == pytest.approx(expected, rel=1e-4)  # the LM loss: what transformers computes


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, checkpoints, corpus_dir, cache_dir):
    """One process, 5 steps from the V3 checkpoint (the reference of the layouts)."""
    from dsv3.train.run import run_training

    out = tmp_path_factory.mktemp("single") / "run"
    opts = TrainOptions(init_from=str(checkpoints["v3"]), data=[str(corpus_dir)], out=str(out), steps=5,
                        batch_size=4, seq_len=32, lr=3e-3, warmup=0, min_lr_ratio=1.0, save_every=5, eval_every=5,
                        eval_tokens=128, cache_dir=str(cache_dir), device="cpu", val_fraction=0.1)
    run_training(opts, show_progress=False, plots=False)
    return out


def init_argv(checkpoint: Path, corpus_dir: Path, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--init-from", str(checkpoint), "--data", str(corpus_dir), "--out", str(out), "--cache-dir",
            str(cache_dir), "--device", "cpu", "--batch-size", "4", "--seq-len", "32", "--eval-tokens", "128",
            "--val-fraction", "0.1", "--steps", "5", "--lr", "3e-3", *CONSTANT_LR, "--save-every", "5",
            "--eval-every", "5", "--tokenizer", "dsv3", *extra]


@pytest.mark.parametrize("nproc,layout", [
    (4, ("--pp", "2", "--micro-batches", "2", "--ep", "2", "--gpus-per-node", "1")),
    (2, ("--ep", "2", "--dp-shard", "fsdp", "--gpus-per-node", "1")),
], ids=["pp2-ep2", "ep2-fsdp"])
def test_layouts_fine_tune_like_one_process(nproc, layout, single_run, checkpoints, corpus_dir, cache_dir,
                                            torchrun, same_training_as, tmp_path):
    out = tmp_path / "run"
    summary = torchrun(nproc, init_argv(checkpoints["v3"], corpus_dir, cache_dir, out, *layout))
    assert summary["step"] == 5 and summary["world_size"] == nproc
    same_training_as(single_run, out)


def test_the_export_loads_in_transformers_like_the_original(single_run, checkpoints):
    """The run's final checkpoint is an ordinary HF folder: transformers loads it (every tensor found) and
    its weights moved from the checkpoint's by the 5 steps."""
    final = single_run / "latest"
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32,
                                                                    output_loading_info=True)
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["v3"], dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(tuned) is type(original)
    moved = [n for n, p in original.state_dict().items() if not torch.equal(p, tuned.state_dict()[n])]
    assert any(".mlp.experts." in n for n in moved) and any("self_attn" in n for n in moved)


def _refused(argv: list[str], capsys) -> str:
    from dsv3.cli import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]  # one error (its details may follow)
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    return errors[0]


def test_a_missing_partial_or_misfit_checkpoint_is_one_error_line_and_no_run_folder(
        checkpoints, corpus_dir, cache_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    argv = lambda folder, *extra: init_argv(folder, corpus_dir, cache_dir, out, *extra)  # noqa: E731
    assert _refused(argv(tmp_path / "nowhere"), capsys).startswith("error: checkpoint folder not found")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((checkpoints["v3"] / "config.json").read_text())
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing: model-00001-of-00002.safetensors" in _refused(argv(partial), capsys)
    misfit = tmp_path / "misfit"
    misfit.mkdir()
    (misfit / "model.safetensors").symlink_to(checkpoints["v3"] / "model.safetensors")
    config = json.loads((checkpoints["v3"] / "config.json").read_text())
    (misfit / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    assert _refused(argv(misfit), capsys).startswith("error: checkpoint does not match its config.json")
    corrupt = tmp_path / "nan"
    corrupt.mkdir()
    tensors = load_file(str(checkpoints["v3"] / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.5.up_proj.weight"][3, 1] = float("nan")
    save_file(tensors, str(corrupt / "model.safetensors"))
    (corrupt / "config.json").write_text((checkpoints["v3"] / "config.json").read_text())
    assert _refused(argv(corrupt), capsys) == ("error: tensor model.layers.2.mlp.experts.5.up_proj.weight holds NaN "
                                               "or infinite values: the checkpoint is corrupt")
    line = _refused(["train", "--init-from", str(checkpoints["v3"]), "--preset", "nano", "--out", str(out)], capsys)
    assert line == "error: --init-from takes the model's config from the checkpoint; drop --preset and --config"
    assert not out.exists()


def test_experts_not_divisible_by_ep_are_refused_before_the_run_folder(tmp_path, corpus_dir, cache_dir):
    """2 processes (`dsv3 launch`), --ep 2, a checkpoint of 3 experts per layer: one error line, exit 2."""
    import os
    import subprocess
    import sys

    folder = write_hf_checkpoint(tmp_path / "three", n_routed_experts=3, n_group=1)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dsv3", "launch", "--nproc", "2",
                           *init_argv(folder, corpus_dir, cache_dir, out, "--ep", "2")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"error: --ep 2 must divide the routed experts, but the checkpoint {folder} "
                                        "has 3 per MoE layer"]
    assert not out.exists()


def test_each_rank_reads_only_its_share_of_the_checkpoint(checkpoints):
    """--ep 2 --dp-shard fsdp on 2 processes: each rank reads its own experts and its FSDP rows of every other
    tensor, so the two together read every byte of the checkpoint once (the router biases, buffers FSDP does
    not shard, once per rank)."""
    from safetensors import safe_open

    from dsv3.testing.init_from_scenarios import read_share_worker
    from dsv3.testing.launch import launch

    folder = checkpoints["v3"]
    layout = {"ep": 2, "dp_shard": "fsdp", "gpus_per_node": 1}
    ranks = launch(read_share_worker, 2, (str(folder), layout), timeout_s=120)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    total = sum(torch.Size(s).numel() * 4 for s in sizes.values())
    biases = sum(torch.Size(s).numel() * 4 for n, s in sizes.items() if n.endswith("e_score_correction_bias"))
    assert ranks[0]["total_bytes"] == total
    assert ranks[0]["bytes_read"] + ranks[1]["bytes_read"] == total + biases
    for rank, got in enumerate(ranks):
        experts = {int(n.split(".")[5]) for n in got["names_read"] if ".mlp.experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4)), rank  # its 4 of the 8 experts, no other


def test_fp8_block_rows_read_alone_equal_the_whole_tensors_rows(tmp_path):
    """An FSDP rank's rows of an FP8 weight: the 128-row blocks holding them, dequantized, then cut."""
    from safetensors.torch import save_file

    from dsv3.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_blocks(w)
    save_file({"a.weight": q, "a.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig(**{**BASE, **KINDS["v2"]})
    cfg.save_json(tmp_path / "config.json")
    values = CheckpointValues(tmp_path, cfg)
    whole = dequantize_fp8_blocks(q, s)
    for rows in (slice(0, 150), slice(150, 300), slice(100, 260)):
        assert torch.equal(values.read("a.weight", rows), whole[rows]), rows
    # only the blocks holding the rows (0:256, 128:300, 0:300) and their scale rows (2, 2, 3 of 2 fp32 each)
    assert values.bytes_read == (256 + 172 + 300) * 200 + (2 + 2 + 3) * 2 * 4


def test_a_dsv3_fp8_checkpoint_with_its_mtp_layer_trains_from_the_same_model(tmp_path):
    """A DeepSeek-format checkpoint with FP8 128x128 blocks and the MTP layer (dsv3 writes both as DeepSeek
    ships them): the trainer's model is `load_pretrained`'s, MTP included (the first step's total loss)."""
    from dsv3.checkpoint import load_pretrained
    from dsv3.model import Transformer

    cfg = ModelConfig(**{**BASE, **KINDS["v3"], "hidden_size": 256, "aux_loss_alpha": 0.0}).validate()
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(tmp_path, fp8=True)
    cfg = pretrained_config(tmp_path)
    assert cfg.num_nextn_predict_layers == 1
    parallel = build_model(cfg, TrainOptions(init_from=str(tmp_path)), World(0, 1, 0, torch.device("cpu")),
                           init_from=CheckpointValues(tmp_path, cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    _, parts = parallel(ids[:, :-1], ids[:, 1:])
    reference = load_pretrained(tmp_path, dtype=torch.float32).train()
    with torch.no_grad():
        expected = reference.loss(ids[:, :-1], ids[:, 1:])
    assert float(parts[2]) > 0 and float(parts[2]) == pytest.approx(float(expected.mtp_loss), rel=1e-5)
    assert float(parts[0]) == pytest.approx(float(expected.loss), rel=1e-5)


def test_a_fine_tuning_run_resumes_from_its_own_checkpoint(single_run, checkpoints, corpus_dir, cache_dir, tmp_path,
                                                           same_training_as):
    """Stopped after 3 of 5 steps and resumed, a fine-tuning run continues from its own (DCP) checkpoint and
    config, not from --init-from's weights: its steps are the uninterrupted run's."""
    from dsv3.train.run import run_training

    out = tmp_path / "run"
    opts = TrainOptions(init_from=str(checkpoints["v3"]), data=[str(corpus_dir)], out=str(out), steps=3,
                        batch_size=4, seq_len=32, lr=3e-3, warmup=0, min_lr_ratio=1.0, save_every=5, eval_every=5,
                        eval_tokens=128, cache_dir=str(cache_dir), device="cpu", val_fraction=0.1)
    run_training(opts, show_progress=False, plots=False)
    resumed = run_training(dataclasses.replace(opts, steps=5), resume=True, show_progress=False, plots=False)
    assert resumed["step"] == 5
    same_training_as(single_run, out)


def test_init_from_with_a_config_is_refused_by_the_options_too(checkpoints, tmp_path, capsys):
    from dsv3.errors import DSV3Error

    with pytest.raises(DSV3Error, match="--init-from takes the model's config from the checkpoint"):
        TrainOptions(init_from=str(checkpoints["v3"]), config=str(checkpoints["v3"])).check()
    line = _refused(["train", "--init-from", str(checkpoints["v3"]), "--config", str(checkpoints["v3"]), "--out",
                     str(tmp_path / "run")], capsys)
    assert line == "error: --init-from takes the model's config from the checkpoint; drop --preset and --config"
    assert not (tmp_path / "run").exists()


def test_run_json_records_each_ranks_resident_peak(single_run):
    """run.json's memory.resident_peak: the process's VmHWM after the first step, above what it counted."""
    memory = json.loads((single_run / "run.json").read_text())["memory"]
    (peak,), (counted,) = memory["resident_peak"], memory["per_rank"]
    assert peak > counted["parameters"] + counted["gradients"] + counted["optimizer"] > 0
    assert "resident_peak" not in counted  # per_rank keeps the tensor counts only


def test_init_from_trains_with_the_checkpoint_s_tokenizer_and_exports_it(hf_tokenizer_dir, corpus_dir, cache_dir,
                                                                        tmp_path, capsys):
    """Without --tokenizer the checkpoint's own tokenizer (and chat template) is used and travels to the
    export byte for byte; a checkpoint without one is one error line that names both choices."""
    import shutil

    from dsv3.cli import main

    folder = write_hf_checkpoint(tmp_path / "ckpt", vocab_size=400)
    bare = tmp_path / "run-bare"
    argv = lambda out: ["train", "--init-from", str(folder), "--data", str(corpus_dir), "--out", str(out),  # noqa: E731
                        "--cache-dir", str(cache_dir), "--device", "cpu", "--batch-size", "2", "--seq-len", "16",
                        "--steps", "1", "--eval-tokens", "32", "--val-fraction", "0.1", "--save-every", "1",
                        "--eval-every", "1"]
    assert _refused(argv(bare), capsys) == (
        f"error: --init-from {folder} has no tokenizer.json; pass --tokenizer DIR (a folder holding the "
        "checkpoint's tokenizer) or --tokenizer dsv3 (train dsv3's own BPE on the data)")
    assert not bare.exists()
    tokenizer = hf_tokenizer_dir(chat_template="{{ messages[0]['content'] }}", name="ckpt-tok")
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    out = tmp_path / "run"
    assert main(argv(out)) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "latest" / name).read_bytes() == (folder / name).read_bytes(), name
