"""`--weights int8|int4` (generate, bench decode) and `dsv3 convert --to int8|int4` on a tiny saved checkpoint: the
converted checkpoint stores the projections ``int_bits`` names as integer groups (the head at 8 bits), loads back
into exactly the model that quantizing at load gives, reads as a float model too, and converts on; bad input is
one error line, exit status 2, nothing written."""

import json

import pytest
import torch
from safetensors import safe_open

from dsv3.cli import main
from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.infer.loading import load_model
from dsv3.kernels.int_weights import IntExperts, IntLinear
from dsv3.model import Transformer
from dsv3.precision.int_groups import SCALE_SUFFIX


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, tokenizer):
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def stored(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def logits(model, ids=(5, 17, 42, 9)):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


@pytest.mark.parametrize("to, dtype", [("int8", torch.int8), ("int4", torch.uint8)])
def test_convert_writes_integer_experts_that_load_as_quantizing_at_load_does(checkpoint, tmp_path, capsys, to, dtype):
    dst = tmp_path / to
    assert main(["convert", str(checkpoint), str(dst), "--to", to]) == 0
    assert f"wrote {dst}:" in capsys.readouterr().out
    tensors = stored(dst)
    at_width = ["model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    for name in at_width:
        assert tensors[name].dtype == dtype and tensors[name + SCALE_SUFFIX].dtype == torch.float16
    assert tensors["lm_head.weight"].dtype == torch.int8  # the head at 8 bits at either width
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight",
                 "model.embed_tokens.weight"):  # read per head, the router, the embedding: as they were
        assert tensors[name].dtype in (torch.bfloat16, torch.float32) and name + SCALE_SUFFIX not in tensors
    assert (dst / "tokenizer.json").exists()

    converted, at_load = load_model(dst, torch.float32, to), load_model(checkpoint, torch.float32, to)
    int_modules = {type(m) for m in converted.modules()} & {IntExperts, IntLinear}
    assert int_modules == {IntExperts, IntLinear} and [type(m) for m in converted.modules()] == [
        type(m) for m in at_load.modules()]
    pairs = [(a, b) for a, b in zip(converted.buffers(), at_load.buffers(), strict=True)
             if a.dtype in (torch.int8, torch.uint8, torch.float16)]
    assert pairs and all(torch.equal(a, b) for a, b in pairs)  # the stored groups are the load-time ones
    # read as a float model, the integer layers are the weights they stand for; the integer model differs from
    # it only by rounding its activations to int8 per group of 32 (a step of 1/127 of each group's largest),
    # which moves these random logits by 2.3% of the largest (benchmarks/int_weights_error.py: a trained model)
    as_float, as_int = logits(load_model(dst, torch.float32)), logits(converted)
    assert 0 < (as_float - as_int).abs().max() < 5e-2 * as_float.abs().max()  # measured 2.3%

    again = tmp_path / f"{to}-again"  # converting a converted checkpoint gives it back
    assert main(["convert", str(dst), str(again), "--to", to]) == 0
    assert all(torch.equal(t, stored(again)[n]) for n, t in tensors.items())


def test_an_fp8_checkpoint_converts_to_int4(checkpoint, tmp_path):
    assert main(["convert", str(checkpoint), str(tmp_path / "fp8"), "--to", "fp8"]) == 0
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "int4"), "--to", "int4"]) == 0
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert stored(tmp_path / "int4")[name].dtype == torch.uint8


def test_convert_bad_input_is_one_error_line_and_nothing_written(tmp_path, capsys):
    cfg = preset("nano").replace(num_hidden_layers=2, moe_intermediate_size=40)  # 40 is not whole groups
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(tmp_path / "odd")
    assert main(["convert", str(tmp_path / "odd"), str(tmp_path / "out"), "--to", "int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "multiple of 32" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["odd"]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_generate_and_bench_decode_with_integer_weights(checkpoint, model, capsys, weights):
    args = ["generate", "--model", str(checkpoint), "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--greedy",
            "--json", "--ignore-eos", "--weights", weights]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    want = Engine(load_model(checkpoint, None, weights)).generate([Request([5, 17, 42], 6, ignore_eos=True)])
    assert out["token_ids"] == want[0].token_ids
    assert main(["bench", "decode", "--model", str(checkpoint), "--context", "16", "--new-tokens", "4", "--json",
                 "--weights", weights]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_per_s"] > 0


def test_an_unknown_weights_format_is_one_error_line(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt-ids", "1", "--weights", "int3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "int8" in err and "int4" in err and "Traceback" not in err
