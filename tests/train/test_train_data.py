"""Corpus discovery and split, the BPE tokenizer and its cache, packing and the resumable sample order."""

from __future__ import annotations

import json
import sysconfig

import numpy as np
import pytest
import torch

from dsv3.data import (
    EOS_TOKEN,
    PackedSequences,
    SampleOrder,
    load_corpus,
    save_tokenizer_files,
    token_byte_lengths,
    tokenize_corpus,
    train_or_load_tokenizer,
)
from dsv3.data.corpus import name_hash
from dsv3.errors import DSV3Error
from dsv3.train.schedule import lr_factor


def test_default_corpus_is_the_stdlib_in_sorted_order_with_a_one_percent_hash_split():
    corpus = load_corpus()
    names = [d.name for d in corpus.train]
    assert names == sorted(names) and "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in n for n in names)
    assert all(name_hash(d.name) < 0.01 for d in corpus.val)
    total = len(corpus.train) + len(corpus.val)
    assert 0.003 * total < len(corpus.val) < 0.03 * total
    assert corpus.description.endswith(sysconfig.get_paths()["stdlib"])


def test_split_is_stable_when_documents_are_added(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"text {i}\n")
    before = load_corpus([str(tmp_path)], val_fraction=0.2)
    for i in range(40, 60):
        (tmp_path / f"f{i}.txt").write_text(f"text {i}\n")
    after = load_corpus([str(tmp_path)], val_fraction=0.2)
    assert {d.name for d in before.val} <= {d.name for d in after.val}
    assert before.fingerprint != after.fingerprint


def test_jsonl_globs_and_bad_input(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "first doc"}\n\n{"text": "second doc", "id": 7}\n')
    (tmp_path / "b.txt").write_text("plain text doc\n")
    corpus = load_corpus([str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt")], val_fraction=0.3)
    docs = {d.name: d.text for d in corpus.train + corpus.val}
    assert docs == {
        f"{tmp_path}/a.jsonl:1": "first doc",
        f"{tmp_path}/a.jsonl:3": "second doc",
        "b.txt": "plain text doc\n",
    }
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    with pytest.raises(DSV3Error, match=r"bad.jsonl:1: .*'text'"):
        load_corpus([str(tmp_path / "bad.jsonl"), str(tmp_path / "b.txt")])
    with pytest.raises(DSV3Error, match="no such file"):
        load_corpus([str(tmp_path / "missing")])
    with pytest.raises(DSV3Error, match="at least 2"):
        load_corpus([str(tmp_path / "b.txt")])


@pytest.fixture
def small_corpus(corpus_dir):
    return load_corpus([str(corpus_dir)], val_fraction=0.1)


def test_tokenizer_specials_bytes_cache_and_transformers_loading(small_corpus, tmp_path):
    tok = train_or_load_tokenizer(small_corpus, 300, tmp_path / "cache")
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id("<|begin_of_text|>") == 0 and tok.token_to_id(EOS_TOKEN) == 1
    text = "def lambda yield über 😀\n  x"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert int(token_byte_lengths(tok)[ids].sum()) == len(text.encode("utf-8"))
    cached = list((tmp_path / "cache").glob("tokenizer-*/tokenizer.json"))
    assert len(cached) == 1
    again = train_or_load_tokenizer(small_corpus, 300, tmp_path / "cache")
    assert again.to_str() == tok.to_str()

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_tokenizer_files(tok, tmp_path / "ckpt", model_max_length=128)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "ckpt" / "tokenizer.json"))
    assert hf(text, add_special_tokens=False)["input_ids"] == ids
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))
    assert auto.eos_token_id == 1 and auto.decode(ids) == text
    with pytest.raises(DSV3Error, match="at least 258"):
        train_or_load_tokenizer(small_corpus, 100, tmp_path / "cache")


def test_streams_end_each_document_with_eos(small_corpus, tmp_path):
    tok = train_or_load_tokenizer(small_corpus, 300, tmp_path)
    streams = tokenize_corpus(small_corpus, tok, tmp_path)
    assert int((streams.train == 1).sum()) == len(small_corpus.train)
    assert int((streams.val == 1).sum()) == len(small_corpus.val)
    first = tok.encode(small_corpus.train[0].text, add_special_tokens=False).ids
    assert list(streams.train[: len(first) + 1]) == first + [1]
    assert streams.train.dtype == np.uint16


def test_packing_covers_every_token_once_as_a_label():
    tokens = np.arange(103, dtype=np.uint16)
    packed = PackedSequences(tokens, seq_len=10)
    assert len(packed) == 10
    inputs, labels = packed.batch(list(range(len(packed))))
    assert inputs.shape == labels.shape == (10, 10)
    assert torch.equal(labels, inputs + 1)
    assert labels.flatten().tolist() == list(range(1, 101))
    with pytest.raises(DSV3Error, match="too few"):
        PackedSequences(tokens[:5], seq_len=10)


def test_sample_order_is_seeded_per_epoch_and_resumable_anywhere():
    order = SampleOrder(7, seed=3)
    run = order.indices(0, 21)  # three epochs
    for epoch in range(3):
        assert sorted(run[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert run[:7] != run[7:14]
    fresh = SampleOrder(7, seed=3)
    assert fresh.indices(5, 9) == run[5:14]  # resuming mid-epoch gives the same continuation
    assert SampleOrder(7, seed=4).indices(0, 7) != run[:7]


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = [lr_factor(s, total=110, warmup=10, min_ratio=0.1) for s in range(110)]
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55)  # halfway down the cosine
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert lr_factor(500, total=110, warmup=10, min_ratio=0.1) == pytest.approx(0.1)


def test_run_json_round_trips(tmp_path):
    from dsv3.train.options import TrainOptions

    opts = TrainOptions(out=str(tmp_path), data=["x"], lr=1e-3)
    opts.save(tmp_path / "run.json")
    assert TrainOptions.load(tmp_path) == opts
    assert json.loads((tmp_path / "run.json").read_text())["lr"] == 1e-3
