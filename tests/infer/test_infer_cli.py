"""`dsv3 generate`, `dsv3 chat`, `dsv3 bench decode` on a tiny saved checkpoint, and resident FP8 weights."""

import copy
import dataclasses
import json
import re
import socket
import time

import pytest
import torch

from dsv3.cli import main
from dsv3.infer.engine import Engine, Request
from dsv3.infer.fp8_weights import FP8BlockLinear, FP8ExpertStack, resident_bytes
from dsv3.infer.loading import load_model
from dsv3.testing.http import serve_in_threads


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


# ---- the context, training run folders, serve's output, readable output ---------------------------

@pytest.fixture(scope="module")
def short_context(tmp_path_factory, model, tokenizer):
    """The tiny model with a 32-position context."""
    folder = tmp_path_factory.mktemp("short")
    short = copy.copy(model)
    short.config = dataclasses.replace(model.config, max_position_embeddings=32)
    short.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_generate_stops_at_the_context_and_says_so(short_context, capsys):
    """--max-new-tokens 1500 on a 1024-position model ran past the context silently."""
    args = ["generate", "--model", str(short_context), "--prompt-ids", "5,6,7,8,9", "--greedy", "--ignore-eos",
            "--max-new-tokens", "1500", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["token_ids"]) == 27 and out["finish_reason"] == "length"
    assert out["capped_to_context"] is True and out["max_new_tokens"] == 27
    assert "warning: --max-new-tokens 1500 capped to 27" in captured.err and "context of 32" in captured.err
    within = run_json(capsys, args[:-3] + ["--max-new-tokens", "4", "--json"])
    assert within["capped_to_context"] is False and len(within["token_ids"]) == 4
    assert main(["generate", "--model", str(short_context), "--prompt-ids", ",".join(["5"] * 32)]) == 2
    assert "fills the model's context of 32" in capsys.readouterr().err


def test_chat_caps_its_replies_at_the_context(short_context, monkeypatch, capsys):
    lines = iter(["hi", "a much longer message that cannot fit the tiny context at all, " * 3, "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(short_context), "--max-new-tokens", "1000", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "capped to" in captured.err and "no longer fits the model's context of 32" in captured.err
    assert captured.out.count("assistant> ") == 1


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, model, tokenizer):
    """A training run folder as `dsv3 train` leaves it: two checkpoints, `latest` at the newer one."""
    from dsv3.train.checkpoints import save_checkpoint

    run = tmp_path_factory.mktemp("run")
    for step in (10, 20):
        save_checkpoint(run, step, model, {"step": step}, {"step": step},
                        lambda folder: tokenizer.save(str(folder / "tokenizer.json")), keep_last=3)
    return run


def test_a_training_run_folder_resolves_to_its_latest_checkpoint(run_folder, checkpoint, capsys):
    """It said "has no tokenizer.json; pass token ids with --prompt-ids" (chat has no such option)."""
    base = ["generate", "--prompt", "the cat", "--max-new-tokens", "5", "--greedy", "--ignore-eos", "--json"]
    by_run = run_json(capsys, base[:1] + ["--model", str(run_folder)] + base[1:])
    by_checkpoint = run_json(capsys, base[:1] + ["--model", str(checkpoint)] + base[1:])
    assert by_run["token_ids"] == by_checkpoint["token_ids"]
    bench = run_json(capsys, ["bench", "decode", "--model", str(run_folder), "--context", "8", "--new-tokens", "3",
                              "--json"])
    assert bench["tokens_per_s"] > 0


def test_chat_with_a_training_run_folder(run_folder, monkeypatch, capsys):
    lines = iter(["hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(run_folder), "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1


def test_chat_without_a_tokenizer_says_what_to_do(tmp_path, model, capsys):
    model.save_pretrained(tmp_path)
    assert main(["chat", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--prompt-ids instead" in err and "dsv3 generate" in err


def test_serve_prints_its_address_and_model_and_logs_each_request(run_folder, monkeypatch, capsys):
    """`dsv3 serve` printed nothing at all."""
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    servers = serve_in_threads(monkeypatch)  # main() returns at once; the server keeps running
    assert main(["serve", "--model", str(run_folder), "--port", "0", "--threads", "1"]) == 0
    assert main(["serve", "--model", str(run_folder), "--port", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"model {run_folder.name!r} from {run_folder / 'latest'}" in err and "parameters" in err
    ports = [int(p) for p in re.findall(r"listening on http://127\.0\.0\.1:(\d+)/v1", err)]
    try:
        deadline = time.time() + 20
        while not all(s.started for s, _ in servers) and time.time() < deadline:
            time.sleep(0.02)
        for port in ports:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"prompt": "the cat", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == run_folder.name
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=20)
    log = [line for line in capsys.readouterr().err.splitlines() if '"POST /v1/completions"' in line]
    assert len(log) == 1 and re.search(r'"POST /v1/completions" 200 3 tokens \d+ ms$', log[0])  # --quiet: none


def test_serve_on_a_port_in_use_is_one_clear_error(checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(checkpoint), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "Traceback" not in err


def test_bench_decode_prints_readable_lines(checkpoint, capsys):
    """It printed one raw float per key (tokens_per_s 312.4567891...)."""
    assert main(["bench", "decode", "--model", str(checkpoint), "--context", "16", "--new-tokens", "3",
                 "--speculative", "mtp"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and re.search(r"\d (µs|ms|s) per step", out) and "MTP" in out
    assert re.search(r"[\d.]+ (B|KB|MB) \(", out)
    assert not re.search(r"\d\.\d{4,}", out), out  # no raw floats
    assert all(len(line) <= 80 for line in out.splitlines())


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["bench", "decode"], ["bench", "serve"]])
def test_help_reads_well_at_80_columns(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and all(len(line) <= 80 for line in out.splitlines())
    assert "``" not in out and "range>" not in out  # no reStructuredText, no typer range metavars
