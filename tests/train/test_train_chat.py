"""`dsv3 train --tokenizer DIR --data chats.jsonl`: a checkpoint's tokenizer and chat template, the loss on the
assistant's tokens only (one process, and --pp 2 / --ep 2 on 2 gloo processes, alike), an export that
carries the same tokenizer files, and one clear error for bad input."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dsv3.cli import main
from dsv3.data import PackedSequences, SampleOrder, load_corpus, tokenize_corpus
from dsv3.data.chat_sft import IGNORE_INDEX
from dsv3.data.chat_template import packaged
from dsv3.data.tokenizer import load_tokenizer_folder
from dsv3.train.metrics import read_rows
from dsv3.train.options import TrainOptions

WORDS = "the weather in paris is sunny today call get_weather with the city thanks answer json".split()
CONSTANT_LR = ("--warmup", "0", "--min-lr-ratio", "1.0")


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def _record(rng: random.Random, i: int) -> dict:
    """Text, plain chats, multi-turn chats and tool calls, in turn."""
    if i % 4 == 0:
        return {"text": _sentence(rng) + ". " + _sentence(rng)}
    messages = [{"role": "system", "content": _sentence(rng)}] if i % 3 == 0 else []
    for _ in range(1 + i % 2):
        messages += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
    if i % 4 != 3:
        return {"messages": messages}
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": None,
                                                               "tool_calls": [call]},
                 {"role": "tool", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
    return {"messages": messages, "tools": [tool]}


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory, hf_tokenizer_dir, tiny_train_config):
    """A tokenizer folder with DeepSeek's tokens and DeepSeek-V3's template, chats in JSONL, and the tiny
    config with a vocabulary that holds the tokenizer."""
    tokenizer = hf_tokenizer_dir(packaged("deepseek_v3").source(), name="chat-tok")
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(_record(rng, i)) + "\n" for i in range(80)))
    config = root / "config.json"
    tiny_train_config.replace(vocab_size=416).save_json(config)
    return tokenizer, data, config


def _argv(setup, cache_dir, out, *extra):
    tokenizer, data, config = setup
    return ["train", "--config", str(config), "--tokenizer", str(tokenizer), "--data", str(data),
            "--out", str(out), "--cache-dir", str(cache_dir), "--device", "cpu", "--batch-size", "4",
            "--seq-len", "32", "--eval-tokens", "128", "--val-fraction", "0.1", "--lr", "3e-3", *CONSTANT_LR,
            "--eval-every", "3", "--save-every", "3", *extra]


@pytest.fixture(scope="module")
def single_run(chat_setup, tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("chat-single") / "run"
    assert main(_argv(chat_setup, cache_dir, out, "--steps", "3")) == 0
    return out


def test_the_loss_covers_the_assistant_tokens_only(chat_setup, single_run, cache_dir):
    """The first step's loss is Transformer.loss on the first batch with the non-assistant labels ignored,
    which differs from the loss over every token."""
    tokenizer, data, config = chat_setup
    opts = TrainOptions.load(single_run)
    assert opts.tokenizer == str(tokenizer)
    streams = tokenize_corpus(load_corpus([str(data)], 0.1), load_tokenizer_folder(tokenizer), cache_dir)
    assert streams.train_mask is not None and 0 < streams.train_mask.mean() < 1
    train = PackedSequences(streams.train, 32, streams.train_mask)
    inputs, labels = train.batch(SampleOrder(len(train), opts.seed).indices(0, 4))
    full = PackedSequences(streams.train, 32).batch(SampleOrder(len(train), opts.seed).indices(0, 4))[1]
    windows = SampleOrder(len(train), opts.seed).indices(0, 4)
    want = np.stack([streams.train_mask[i * 32 + 1 : i * 32 + 33] for i in windows])
    assert ((labels == IGNORE_INDEX) == ~torch.from_numpy(want)).all()
    assert (labels[labels != IGNORE_INDEX] == full[labels != IGNORE_INDEX]).all()
    from dsv3.config import load_config
    from dsv3.train.distributed import World
    from dsv3.train.run import build_model

    # the run's fresh model: each tensor seeded by the run's seed and its name (dsv3.model.init)
    model = build_model(load_config(config), opts, World(0, 1, 0, torch.device("cpu"))).model.train()
    first = read_rows(single_run / "metrics.jsonl")[0]
    with torch.no_grad():
        masked = float(model.loss(inputs, labels).lm_loss)
        unmasked = float(model.loss(inputs, full).lm_loss)
    assert first["loss"] == pytest.approx(masked, rel=1e-5)
    assert abs(masked - unmasked) > 1e-3


@pytest.mark.parametrize("layout", [("--pp", "2"), ("--ep", "2")], ids=["pp2", "ep2"])
def test_masked_run_under_two_processes_matches_one(chat_setup, single_run, cache_dir, torchrun, tmp_path, layout):
    out = tmp_path / "run"
    torchrun(2, _argv(chat_setup, cache_dir, out, "--steps", "3", *layout))
    one, two = (read_rows(folder / "metrics.jsonl") for folder in (single_run, out))
    assert [(r["kind"], r["step"]) for r in one] == [(r["kind"], r["step"]) for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "total_loss", "mtp_loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        if a["kind"] == "train":
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]


def test_the_export_carries_the_tokenizer_and_template(chat_setup, single_run):
    """transformers loads the fine-tuned folder's tokenizer and chat template as it loaded the original's."""
    tokenizer = chat_setup[0]
    latest = single_run / "latest"
    assert (latest / "config.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (latest / name).read_bytes() == (tokenizer / name).read_bytes()
    messages = [{"role": "user", "content": "the weather"}, {"role": "assistant", "content": "sunny"}]
    original, exported = (AutoTokenizer.from_pretrained(folder) for folder in (tokenizer, latest))
    assert exported.apply_chat_template(messages) == original.apply_chat_template(messages)


BAD_LINES = {
    "bad JSON": ('{"messages": [', "not valid JSON"),
    "no messages": ('{"conversation": []}', "'messages'"),
    "bad role": ('{"messages": [{"role": "robot", "content": "hi"}]}', "role 'robot'"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_malformed_chat_line_is_one_clear_error(chat_setup, cache_dir, tmp_path, capsys, case):
    line, words = BAD_LINES[case]
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + line + "\n")
    argv = _argv(chat_setup, cache_dir, tmp_path / "out", "--steps", "1")
    argv[argv.index("--data") + 1] = str(data)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data}:2: ") and words in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_without_tokenizer_json_is_one_clear_error(chat_setup, cache_dir, tmp_path, capsys):
    argv = _argv(chat_setup, cache_dir, tmp_path / "out", "--steps", "1")
    argv[argv.index("--tokenizer") + 1] = str(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no tokenizer.json" in err and "--tokenizer dsv3" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_vocabulary_smaller_than_the_tokenizer_is_one_clear_error(chat_setup, cache_dir, tmp_path, capsys):
    size = load_tokenizer_folder(chat_setup[0]).tokenizer.get_vocab_size()
    assert main(_argv(chat_setup, cache_dir, tmp_path / "out", "--steps", "1", "--vocab-size", str(size - 1))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and f"has {size} token ids" in err and not (tmp_path / "out").exists()


def test_text_records_are_bos_text_eos(chat_setup, tmp_path):
    """{"text": ...} lines with a checkpoint's tokenizer: each document is its BOS, its tokens, its EOS,
    every token a label (no mask without chats)."""
    data = tmp_path / "notes.jsonl"
    data.write_text(json.dumps({"text": "the weather in paris"}) + "\n" + json.dumps({"text": "sunny today"}) + "\n")
    encoding = load_tokenizer_folder(chat_setup[0])
    corpus = load_corpus([str(data)], 0.5)
    streams = tokenize_corpus(corpus, encoding, tmp_path / "cache")
    tok = encoding.tokenizer
    bos, eos = tok.token_to_id("<｜begin▁of▁sentence｜>"), tok.token_to_id("<｜end▁of▁sentence｜>")
    for stream, docs in ((streams.train, corpus.train), (streams.val, corpus.val)):
        want = [t for d in docs for t in [bos, *tok.encode(d.text, add_special_tokens=False).ids, eos]]
        assert stream.tolist() == want
    assert streams.train_mask is None and streams.val_mask is None
