"""`dsv3 generate`, `dsv3 chat`, `dsv3 bench decode` on a tiny saved checkpoint, and resident FP8 weights."""

import json

import pytest
import torch

from dsv3.cli import main
from dsv3.infer.engine import Engine, Request
from dsv3.infer.fp8_weights import FP8BlockLinear, FP8ExpertStack, resident_bytes
from dsv3.infer.loading import load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, tokenizer):
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def run_json(capsys, args):
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_with_prompt_ids(checkpoint, model, capsys):
    args = ["generate", "--model", str(checkpoint), "--prompt-ids", "5,17,42", "--max-new-tokens", "8", "--greedy",
            "--json", "--ignore-eos"]
    out = run_json(capsys, args)
    assert out["token_ids"] == Engine(model).generate([Request([5, 17, 42], 8)])[0].token_ids
    assert out["tokens_per_s"] > 0 and "acceptance_rate" not in out
    layers = model.config.num_hidden_layers + model.config.num_nextn_predict_layers
    row = (model.config.kv_lora_rank + model.config.qk_rope_head_dim) * 4
    assert out["cache_bytes"] % (layers * row) == 0 and out["cache_bytes"] >= layers * row * 11
    spec = run_json(capsys, args + ["--speculative", "mtp"])
    assert spec["token_ids"] == out["token_ids"] and 0 <= spec["acceptance_rate"] <= 1


def test_generate_text_streams_and_sampling_repeats_with_a_seed(checkpoint, capsys):
    base = ["generate", "--model", str(checkpoint), "--prompt", "the cat", "--max-new-tokens", "10", "--ignore-eos"]
    a = run_json(capsys, base + ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "3", "--json"])
    b = run_json(capsys, base + ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "3", "--json"])
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert main(base + ["--greedy"]) == 0
    captured = capsys.readouterr()
    greedy = run_json(capsys, base + ["--greedy", "--json"])
    assert captured.out.strip() == greedy["text"].strip()  # streamed text is the same text
    assert "tokens/s" in captured.err


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "x", "--prompt-ids", "1"], "exactly one"),
    (["--prompt-ids", "1,a"], "integers"),
    (["--prompt-ids", "99999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--greedy", "--temperature", "0.5"], "--greedy"),
    (["--prompt-ids", "1", "--speculative", "eagle"], "mtp or none"),
    (["--prompt-ids", "1", "--cache-dtype", "int4"], "cache-dtype"),
])
def test_generate_bad_input_is_one_clear_error(checkpoint, capsys, extra, message):
    assert main(["generate", "--model", str(checkpoint), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_missing_model_and_missing_tokenizer(tmp_path, model, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    model.save_pretrained(tmp_path / "bare")
    assert main(["generate", "--model", str(tmp_path / "bare"), "--prompt", "hi"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_chat_session(checkpoint, monkeypatch, capsys):
    lines = iter(["hello", "/reset", "the dog", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 2


def test_bench_decode_json(checkpoint, model, capsys):
    out = run_json(capsys, ["bench", "decode", "--model", str(checkpoint), "--context", "40", "--new-tokens", "6",
                            "--batch", "2", "--json", "--cache-dtype", "bf16"])
    cfg = model.config
    assert out["tokens_per_s"] > 0 and out["batch"] == 2
    assert out["cache_bytes_per_token_per_layer"] == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


def test_fp8_resident_weights_halve_memory_and_keep_the_logits(tmp_path, model):
    model.save_pretrained(tmp_path, fp8=True)
    dequantized = load_model(tmp_path, torch.float32)  # dequantized at load
    resident = load_model(tmp_path, torch.float32, weights="fp8")  # kept as FP8, dequantized per layer
    ids = torch.tensor([[5, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        assert torch.equal(dequantized(ids), resident(ids))
    fp8_parts = [m for m in resident.modules() if isinstance(m, FP8BlockLinear | FP8ExpertStack)]
    fp8_bytes = sum(m.weight_fp8.nbytes + m.weight_scale_inv.nbytes for m in fp8_parts)
    bf16_bytes = sum(m.weight_fp8.numel() * 2 for m in fp8_parts)
    assert fp8_bytes < 0.52 * bf16_bytes
    bf16_model = load_model(tmp_path, torch.bfloat16)
    assert resident_bytes(bf16_model) - resident_bytes(load_model(tmp_path, torch.bfloat16, weights="fp8")) > \
        0.45 * bf16_bytes
    greedy = Engine(resident).generate([Request([5, 17, 42], 6)])[0].token_ids
    assert greedy == Engine(dequantized).generate([Request([5, 17, 42], 6)])[0].token_ids
