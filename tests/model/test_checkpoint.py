"""DeepSeek-format checkpoints: MTP survives bit for bit, FP8 blocks dequantize exactly, bad files fail clearly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv3 import load_pretrained
from dsv3.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks
from dsv3.cli import main
from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.model import Transformer

CFG = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  rope_scaling=None).validate()


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = Transformer(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        m.moe_layers()[0].gate.e_score_correction_bias.normal_()
    return m


def _all_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_names_follow_deepseek_and_mtp_layer_is_saved(model, tmp_path):
    model.save_pretrained(tmp_path)
    names = set(_all_tensors(tmp_path))
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
                   "mlp.experts.0.down_proj.weight"):
        assert f"model.layers.2.{suffix}" in names


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 20_000])
def test_save_load_save_is_bit_exact_including_mtp(model, tmp_path, shard_bytes):
    model.save_pretrained(tmp_path / "a", max_shard_bytes=shard_bytes)
    if shard_bytes < 2**20:
        assert (tmp_path / "a" / "model.safetensors.index.json").exists()
    reloaded = load_pretrained(tmp_path / "a")
    reloaded.save_pretrained(tmp_path / "b")
    a, b = _all_tensors(tmp_path / "a"), _all_tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 64, (1, 12))
    h = model.hidden_states(ids)
    with torch.no_grad():
        same = [torch.equal(m.mtp_logits(0, m.mtp_hidden(0, h[:, :-1], ids[:, 1:], torch.arange(11)[None])),
                            model.mtp_logits(0, model.mtp_hidden(0, h[:, :-1], ids[:, 1:], torch.arange(11)[None])))
                for m in (reloaded,)]
    assert all(same)


def test_distinct_mtp_head_copy_is_kept(model, tmp_path):
    model.save_pretrained(tmp_path / "a")
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    tensors["model.layers.2.shared_head.head.weight"] = torch.randn(64, 48)
    save_file(tensors, tmp_path / "a" / "model.safetensors")
    reloaded = load_pretrained(tmp_path / "a")
    reloaded.save_pretrained(tmp_path / "b")
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert torch.equal(again["model.layers.2.shared_head.head.weight"],
                       tensors["model.layers.2.shared_head.head.weight"])


def test_fp8_block_dequantization_is_exact():
    torch.manual_seed(1)
    w = torch.randn(300, 200) * 3
    q, scale_inv = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    deq = dequantize_fp8_blocks(q, scale_inv)
    for i in range(3):
        for j in range(2):
            block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert torch.equal(deq[block], q[block].float() * scale_inv[i, j])
    assert ((deq - w).abs() / w.abs().amax()).max() < 0.07


def test_fp8_checkpoint_loads_with_exact_dequantization(model, tmp_path):
    model.save_pretrained(tmp_path, fp8=True)
    stored = _all_tensors(tmp_path)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    expected = dequantize_fp8_blocks(stored[name], stored[name + "_scale_inv"])
    assert torch.equal(loaded.model.layers[1].mlp.experts.up_proj[2], expected)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"


def test_convert_fp8_to_bf16_and_back(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "fp8", fp8=True)
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "bf16"), "--to", "bf16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dequantized"] > 0
    fp8, bf16 = _all_tensors(tmp_path / "fp8"), _all_tensors(tmp_path / "bf16")
    name = "model.layers.0.self_attn.o_proj.weight"
    assert bf16[name].dtype == torch.bfloat16 and name + "_scale_inv" not in bf16
    assert torch.equal(bf16[name], dequantize_fp8_blocks(fp8[name], fp8[name + "_scale_inv"]).bfloat16())
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "fp8b"), "--to", "fp8"]) == 0
    assert load_pretrained(tmp_path / "fp8b") is not None
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "fp8b"), "--to", "fp8"]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


def _expect_error(path, *phrases):
    with pytest.raises(DSV3Error) as err:
        load_pretrained(path)
    for phrase in phrases:
        assert phrase in str(err.value)


def test_missing_unexpected_and_misshaped_tensors_are_named(model, tmp_path):
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.zeros(47)
    save_file(tensors, f)
    _expect_error(tmp_path, "missing tensors: model.layers.0.self_attn.o_proj.weight",
                  "unexpected tensors: model.layers.0.self_attn.bogus.weight",
                  "mis-shaped tensors: model.norm.weight (checkpoint (47,), model (48,))")


def test_truncated_and_corrupt_files_give_clear_errors(model, tmp_path, capsys):
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _expect_error(tmp_path, "corrupt or truncated")
    f.write_bytes(b"\x00" * 64)
    _expect_error(tmp_path, "corrupt or truncated")
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--to", "bf16"]) == 2
    assert "corrupt or truncated" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_save_into_existing_folder_keeps_other_files(model, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    model.save_pretrained(tmp_path)  # single file now: old shards and index must go
    assert (tmp_path / "tokenizer.json").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert load_pretrained(tmp_path) is not None


@pytest.mark.parametrize("fp8", [False, True])
def test_shards_are_converted_one_at_a_time(model, tmp_path, monkeypatch, fp8):
    """save_pretrained holds only one shard's converted tensors at a time (a 671B model must not be
    copied whole), and each shard's stored bytes stay within the limit unless one tensor alone exceeds it."""
    from dsv3 import checkpoint

    limit, seen = 40_000, []
    prepare = checkpoint._prepare

    def recording_prepare(items, dtype, fp8):
        out = prepare(items, dtype, fp8)
        seen.append((len(out), sum(t.numel() * t.element_size() for t in out.values())))
        return out

    monkeypatch.setattr(checkpoint, "_prepare", recording_prepare)
    model.save_pretrained(tmp_path / "ckpt", max_shard_bytes=limit, fp8=fp8)
    assert len(seen) > 2
    assert all(nbytes <= limit or count <= 2 for count, nbytes in seen)  # count 2: one FP8 weight + scales
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(seen)
    assert index["metadata"]["total_size"] == sum(nbytes for _, nbytes in seen)
