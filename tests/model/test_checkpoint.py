"""DeepSeek-format checkpoints: MTP survives bit for bit, FP8 blocks dequantize exactly, bad files fail clearly."""

import contextlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

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


# ---- issue 16: defaults, dtypes, NaN/Inf, convert validation, permissions, non-regular files -------

def _hf_parity():
    """The parity helpers of test_hf_parity.py (random weights, token ids), loaded by path."""
    spec = importlib.util.spec_from_file_location("hf_parity_helpers", Path(__file__).with_name("test_hf_parity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256)


@pytest.mark.parametrize("hf_class, routing", [
    ("DeepseekV2", dict(n_routed_experts=8, num_experts_per_tok=2)),  # softmax, greedy, no norm, scale 1, all MoE
    ("DeepseekV3", dict(n_routed_experts=16)),  # sigmoid, noaux_tc, 8 groups keep 4, top-8, scale 2.5
])
def test_checkpoint_with_transformers_own_config_loads_with_the_same_logits(tmp_path, hf_class, routing):
    """Config and weights written by transformers itself, routing left at its class defaults: the
    config.json then lacks the fields transformers' modeling code never reads (V2: scoring_func)."""
    transformers = pytest.importorskip("transformers")
    parity = _hf_parity()
    hf_config = getattr(transformers, hf_class + "Config")(**SIZES, **routing)
    torch.manual_seed(0)
    hf = getattr(transformers, hf_class + "ForCausalLM")(hf_config).eval()
    parity._randomize(hf, 3)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "scoring_func" not in written and "moe_layer_freq" not in written
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    ids = parity._ids(ours.config, 4)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def _mutate(folder, name=None, value=None, drop=None, config=None):
    """Rewrite the single-file checkpoint in ``folder``: set/drop one tensor, change config keys."""
    f = folder / "model.safetensors"
    tensors = load_file(f)
    if drop:
        del tensors[drop]
    if name:
        tensors[name] = value(tensors[name]) if callable(value) else value
    save_file(tensors, f)
    if config:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("dtype, shown", [(torch.int64, "int64"), (torch.bool, "bool"), (torch.int8, "int8"),
                                          (torch.float8_e5m2, "float8_e5m2")])
def test_integer_bool_and_unsupported_fp8_weights_are_refused_by_name(model, tmp_path, dtype, shown):
    model.save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _mutate(tmp_path, name, lambda t: (t * 100).to(dtype))
    _expect_error(tmp_path, f"tensor {name} is stored as {shown}")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_by_name(model, tmp_path, capsys, fp8, bad):
    model.save_pretrained(tmp_path / "ckpt", fp8=fp8)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"

    def poison(t):
        t = t.clone()
        t.view(-1)[-1] = bad
        return t

    _mutate(tmp_path / "ckpt", name + "_scale_inv" if fp8 else name, poison)  # FP8: the scale makes it NaN/Inf
    _expect_error(tmp_path / "ckpt", f"tensor {name} holds NaN or infinite values")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "bf16"]) == 2
    assert f"tensor {name} holds NaN" in capsys.readouterr().err and not (tmp_path / "out").exists()


def _transposed(t):
    return t.t().contiguous()


BROKEN = {
    "missing tensor": dict(drop="model.layers.0.self_attn.o_proj.weight"),
    "missing expert": dict(drop="model.layers.1.mlp.experts.3.down_proj.weight"),
    "missing norm": dict(drop="model.norm.weight"),
    "missing MTP projection": dict(drop="model.layers.2.eh_proj.weight"),
    "missing router bias": dict(drop="model.layers.1.mlp.gate.e_score_correction_bias"),
    "transposed projection": dict(name="model.layers.0.self_attn.kv_b_proj.weight", value=_transposed),
    "transposed expert": dict(name="model.layers.1.mlp.experts.0.gate_proj.weight", value=_transposed),
    "transposed embedding": dict(name="model.embed_tokens.weight", value=_transposed),
    "mis-shaped norm": dict(name="model.norm.weight", value=torch.ones(47)),
    "mis-shaped head": dict(name="lm_head.weight", value=torch.zeros(63, 48)),
    "mis-shaped router": dict(name="model.layers.1.mlp.gate.weight", value=torch.zeros(5, 48)),
    "one expert of another shape": dict(name="model.layers.1.mlp.experts.1.up_proj.weight", value=torch.zeros(8, 48)),
    "extra tensor": dict(name="model.layers.0.self_attn.o_proj.bias", value=torch.zeros(48)),
    "extra expert": dict(name="model.layers.1.mlp.experts.4.up_proj.weight", value=torch.zeros(16, 48)),
    "integer tensor": dict(name="model.layers.0.input_layernorm.weight", value=lambda t: t.long()),
    "bool tensor": dict(name="model.layers.0.post_attention_layernorm.weight", value=lambda t: t > 0),
    "config: hidden size": dict(config={"hidden_size": 64}),
    "config: more layers": dict(config={"num_hidden_layers": 3}),
    "config: more experts": dict(config={"n_routed_experts": 8, "n_group": 2}),
    "config: low-rank query": dict(config={"q_lora_rank": 16}),
    "config: wider experts": dict(config={"moe_intermediate_size": 32}),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_convert_refuses_what_load_refuses_with_the_same_message(model, tmp_path, capsys, case):
    model.save_pretrained(tmp_path / "ckpt")
    _mutate(tmp_path / "ckpt", **BROKEN[case])
    with pytest.raises(DSV3Error) as err:
        load_pretrained(tmp_path / "ckpt")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "fp8"]) == 2
    assert capsys.readouterr().err == f"error: {err.value}\n"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_fp8_scale_of_the_wrong_block_shape_is_refused(model, tmp_path):
    model.save_pretrained(tmp_path, fp8=True)
    name = "model.layers.0.self_attn.o_proj.weight"
    _mutate(tmp_path, name + "_scale_inv", torch.ones(2, 2))
    _expect_error(tmp_path, f"tensor {name}_scale_inv has shape (2, 2), but the 128x128 blocks of {name}")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_convert_leaves_optimizer_state_behind_and_outputs_follow_the_umask(model, tmp_path, mask):
    from dsv3.train.checkpoints import save_checkpoint

    with _umask(mask):
        model.save_pretrained(tmp_path / "src")
        for extra in ("trainer_state.pt", "trainer_state.rank1.pt", "trainer_state.json", "tokenizer.json"):
            (tmp_path / "src" / extra).write_text("{}")
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "bf16"]) == 0
        step = save_checkpoint(tmp_path / "run", 1, model, {"step": 1}, {"step": 1}, lambda folder: None, 2)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["config.json", "model.safetensors",
                                                                     "tokenizer.json"]
    for folder in (tmp_path / "src", tmp_path / "dst", step):
        assert _mode(folder) == 0o777 & ~mask, folder
        for f in folder.iterdir():  # a training checkpoint's sharded state is a folder (dcp/)
            assert _mode(f) == (0o777 if f.is_dir() else 0o666) & ~mask, f


_FIFO_WRITER = """
import os, sys, time
time.sleep(float(sys.argv[2]))
while True:
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader waits
    except OSError:
        pass
    time.sleep(0.05)
"""


@contextlib.contextmanager
def fifo_unblocked_after(fifo: Path, seconds: float):
    """Fail instead of hanging: should the code under test open ``fifo`` and block (safetensors blocks
    in Rust holding the GIL, so this must be another process), open its write end after ``seconds``:
    the reader then sees an empty file and the test fails on its assertions."""
    writer = subprocess.Popen([sys.executable, "-c", _FIFO_WRITER, str(fifo), str(seconds)])
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("fifo", ["model.safetensors", "model.safetensors.index.json", "config.json"])
def test_fifo_in_place_of_a_checkpoint_file_is_refused_at_once(model, tmp_path, capsys, fifo):
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / fifo).unlink(missing_ok=True)
    os.mkfifo(tmp_path / "ckpt" / fifo)
    with fifo_unblocked_after(tmp_path / "ckpt" / fifo, 5):
        _expect_error(tmp_path / "ckpt", "is not a regular file")
        assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "bf16"]) == 2
        assert "is not a regular file" in capsys.readouterr().err
        assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt-ids", "1,2", "--max-new-tokens",
                     "2"]) == 2
        assert "is not a regular file" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_generate_refuses_a_fifo_tokenizer_at_once(model, tmp_path, capsys):
    model.save_pretrained(tmp_path)
    os.mkfifo(tmp_path / "tokenizer.json")
    with fifo_unblocked_after(tmp_path / "tokenizer.json", 5):
        assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    assert "tokenizer.json is not a regular file" in capsys.readouterr().err


def test_generation_stops_at_any_of_a_list_of_eos_ids(model):
    from dsv3.infer.engine import Engine, Request
    from dsv3.infer.loading import eos_ids

    free = Engine(model, eos_token_ids=frozenset()).generate([Request([1, 2, 3], 6)])[0]
    first = free.token_ids[0]
    other = 0 if first else 1
    listed = Transformer(CFG.replace(eos_token_id=[other, first])).eval()
    listed.load_state_dict(model.state_dict())
    assert eos_ids(listed, None) == frozenset({other, first})
    result = Engine(listed).generate([Request([1, 2, 3], 6)])[0]
    assert result.token_ids == [first] and result.finish_reason == "stop"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-blocks"])
def test_an_expert_parallel_rank_reads_only_its_experts(model, tmp_path, monkeypatch, fp8):
    """`load_pretrained(..., experts=[3, 1])` keeps exactly those experts of every MoE layer, in that order,
    and never reads the others from the files (their weights and FP8 scales); the rest is the whole model."""
    import dsv3.checkpoint as ckpt

    model.save_pretrained(tmp_path, dtype=torch.bfloat16, fp8=fp8)
    read: list[str] = []
    real_read = ckpt._read_one

    def counting_read(stream, f, name, info, data_start):
        read.append(name)
        return real_read(stream, f, name, info, data_start)

    whole = ckpt.load_pretrained(tmp_path)
    monkeypatch.setattr(ckpt, "_read_one", counting_read)
    part = ckpt.load_pretrained(tmp_path, experts=[3, 1])
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts_read == {1, 3}
    for a, b in zip(whole.moe_layers(), part.moe_layers(), strict=True):
        assert b.held_experts.tolist() == [3, 1]
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(b.experts, name), getattr(a.experts, name)[[3, 1]])
    rest = {n: t for n, t in whole.state_dict().items() if ".experts." not in n}
    assert all(torch.equal(part.state_dict()[n], t) for n, t in rest.items())
