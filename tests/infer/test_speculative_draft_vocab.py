"""MTP drafts over a frequency-ranked draft vocabulary (FR-Spec): greedy output identical to plain greedy,
sampled output distributed exactly as plain sampling with q restricted to the K tokens, the draft head's
logits equal to the full head's columns, `dsv3 draft-vocab` and --draft-vocab's errors; and the greedy
bookkeeping shortcuts equal to the rules they replace."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from dsv3.cli import main
from dsv3.errors import DSV3Error
from dsv3.infer import draft_vocab as dv
from dsv3.infer.draft_vocab import DraftVocab
from dsv3.infer.engine import Engine, Request, greedy_verify
from dsv3.infer.sampling import SamplingParams, all_finite, greedy_tokens, probabilities
from dsv3.infer.speculative import verify
from dsv3.kernels.decode import FastDecode

sys.path.insert(0, str(Path(__file__).parent))
from test_infer_speculative import chi_square_p, exact_pair_distribution  # noqa: E402

from conftest import tiny_model, tiny_tokenizer  # noqa: E402


def test_greedy_with_a_draft_vocabulary_equals_plain_greedy_with_accepts_and_rejects():
    model = tiny_model(vocab=12, gain=3.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 0], [3, 3, 3, 3]]
    plain = [Engine(model).generate([Request(p, 40)])[0].token_ids for p in prompts]
    vocab = [7, 2, 9, 0, 5, 11]  # half the vocabulary: some targets are outside it and are still emitted
    for fast in (True, False):
        engine = Engine(model, speculative=True, draft_vocab=vocab, fast=fast)
        assert [engine.generate([Request(p, 40)])[0].token_ids for p in prompts] == plain
        batch = Engine(model, speculative=True, draft_vocab=vocab, fast=fast)
        assert [r.token_ids for r in batch.generate([Request(p, 40) for p in prompts])] == plain
        assert 0 < batch.last_stats.accepted < batch.last_stats.drafted  # both branches were taken
    outside = {t for seq in plain for t in seq} - set(vocab)
    assert outside  # the output has tokens the draft can never propose


def test_drafts_come_from_the_draft_vocabulary():
    model = tiny_model(vocab=12, gain=3.0)
    engine = Engine(model, speculative=True, draft_vocab=[3, 8])
    batch = engine.start([Request([1, 2, 3], 30, SamplingParams(1.0, seed=0)), Request([4, 5], 30)])
    seen = set()
    while batch.rows:
        seen |= {r.draft for r in batch.rows}
        batch.step()
    assert seen <= {3, 8}
    sampled = engine.start([Request([1, 2, 3], 4, SamplingParams(1.0, seed=1))]).rows[0]
    assert sampled.draft_q.shape == (12,) and float(sampled.draft_q.sum()) == pytest.approx(1.0)
    assert set(sampled.draft_q.nonzero().flatten().tolist()) <= {3, 8}


def test_speculative_sampling_with_a_restricted_draft_preserves_the_distribution():
    """q is a distribution over 3 of the 6 tokens (zero elsewhere): rejection sampling stays exact."""
    model = tiny_model(vocab=6, gain=2.0, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = [1, 4, 2]
    n = 3000
    engine = Engine(model, speculative=True, draft_vocab=[0, 3, 5])
    results = engine.generate([Request(prompt, 3, SamplingParams(1.0, top_p=0.95, seed=i)) for i in range(n)])
    assert 0.1 < engine.last_stats.acceptance_rate < 0.95
    counts = torch.zeros(6, 6)
    for r in results:
        counts[r.token_ids[1], r.token_ids[2]] += 1
    exact = exact_pair_distribution(model, prompt, params)
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3


def test_verify_with_a_q_that_is_zero_outside_the_draft_vocabulary():
    """Unit level: p has mass where q has none; the emitted token still follows p."""
    p = torch.tensor([0.4, 0.1, 0.3, 0.2, 0.0])
    q = DraftVocab([1, 2], 5).spread(torch.tensor([0.7, 0.3]))
    assert q.tolist() == pytest.approx([0.0, 0.7, 0.3, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        draft = int(torch.multinomial(q, 1, generator=gen))
        counts[verify(torch.stack([p, p]), q[None], [draft], gen)[0][0]] += 1
    assert counts[4] == 0 and chi_square_p(counts[:4], p[:4]) > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draft_heads_logits_are_the_full_heads_columns(dtype):
    model = tiny_model(vocab=300).to(dtype)
    ids = torch.tensor([299, 0, 17, 150, 3])
    vocab = DraftVocab(ids, 300)
    h = torch.randn(2, model.config.hidden_size).to(dtype)
    full = model.mtp_logits(0, h)
    for decoder in (FastDecode(model), FastDecode(model, use_kernels=False), model):
        got = vocab.logits(decoder, 0, h)
        assert got.shape == (2, 5)
        torch.testing.assert_close(got, full[:, ids], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    assert vocab.head_weight(FastDecode(model).head).w.is_contiguous()


def test_greedy_shortcuts_equal_the_rules_they_replace():
    """greedy_verify is verify() on one-hot p and q; greedy_tokens is torch.argmax (first index on ties);
    all_finite is isfinite().all(), also where the sum overflows."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(50):
        logits = torch.randint(-3, 3, (2, 7)).float()  # many ties
        p = probabilities(logits, greedy)
        for draft in range(7):
            want = verify(p, torch.eye(7)[draft][None], [draft], gen)
            assert greedy_verify(logits, draft) == want
        assert greedy_verify(logits, None) == ([int(logits[0].argmax())], 0)
        assert greedy_tokens(logits.bfloat16()) == logits.argmax(-1).tolist()
    big = torch.full((4,), 3e38)
    assert all_finite(big) and all_finite(torch.zeros(3))
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not all_finite(torch.tensor([1.0, bad])) and not all_finite(torch.tensor([3e38, 3e38, bad]))


# ---- the file and the options --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft_vocab")
    tiny_model(vocab=300).save_pretrained(folder)
    tiny_tokenizer(300).save(str(folder / "tokenizer.json"))
    data = folder.parent / f"{folder.name}_corpus"
    data.mkdir()
    (data / "a.txt").write_text("the cat sat on the mat " * 50)
    (data / "b.txt").write_text("hello world " * 10)
    return folder, data


def test_draft_vocab_command_ranks_the_corpus_tokens_and_generate_uses_them(checkpoint, capsys):
    folder, data = checkpoint
    assert main(["draft-vocab", "--model", str(folder), "--data", str(data)]) == 0
    assert "draft_vocab.json" in capsys.readouterr().err
    doc = json.loads((folder / dv.FILE).read_text())
    assert sorted(doc["ids"]) == list(range(300)) and doc["vocab_size"] == 300
    assert doc["counts"] == sorted(doc["counts"], reverse=True) and doc["tokens_counted"] == sum(doc["counts"])
    tok = tiny_tokenizer(300)
    expected = Counter(i for f in sorted(data.iterdir()) for i in tok.encode(f.read_text()).ids)
    assert {i: c for i, c in zip(doc["ids"], doc["counts"], strict=True) if c} == dict(expected)
    assert doc["ids"][0] == expected.most_common(1)[0][0]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    args = ["generate", "--model", str(folder), "--prompt-ids", "5,17,42", "--max-new-tokens", "12", "--greedy",
            "--json", "--ignore-eos", "--speculative", "mtp"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(args + ["--draft-vocab", "16"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["token_ids"] == full["token_ids"] and small["draft_vocab"] == 16


@pytest.mark.parametrize("content, extra, message", [
    (None, ["--draft-vocab", "8"], "dsv3 draft-vocab --model"),
    ("{not json", ["--draft-vocab", "8"], "cannot read"),
    ('{"ids": [1, 2]}', ["--draft-vocab", "1"], "not a draft vocabulary"),
    ('{"format": "dsv3-draft-vocab", "vocab_size": 12, "ids": [1]}', ["--draft-vocab", "1"], "vocabulary of 12"),
    ('{"format": "dsv3-draft-vocab", "vocab_size": 300, "ids": [1, 2]}', ["--draft-vocab", "3"], "only 2"),
    ('{"format": "dsv3-draft-vocab", "vocab_size": 300, "ids": [1, 1]}', ["--draft-vocab", "2"], "repeats"),
    ('{"format": "dsv3-draft-vocab", "vocab_size": 300, "ids": [1, 400]}', ["--draft-vocab", "2"], "outside"),
    ('{"format": "dsv3-draft-vocab", "vocab_size": 300, "ids": ["a"]}', ["--draft-vocab", "1"], "integer"),
    ("", ["--draft-vocab", "301"], "[1, 300]"),
    ("", ["--draft-vocab", "-1"], ">= 0"),
])
def test_draft_vocab_errors_are_one_clear_line(tmp_path, content, extra, message, capsys):
    tiny_model(vocab=300).save_pretrained(tmp_path)
    if content:
        (tmp_path / dv.FILE).write_text(content)
    code = main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--speculative", "mtp", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_draft_vocab_needs_speculation_and_a_tokenizer(tmp_path, capsys):
    tiny_model(vocab=300).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--draft-vocab", "8"]) == 2
    assert "needs --speculative mtp" in capsys.readouterr().err
    assert main(["draft-vocab", "--model", str(tmp_path)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    with pytest.raises(DSV3Error, match="needs --speculative mtp"):
        Engine(tiny_model(vocab=12), draft_vocab=[1, 2])
    with pytest.raises(DSV3Error, match="outside"):
        Engine(tiny_model(vocab=12), speculative=True, draft_vocab=[1, 12])


def test_serve_and_chat_build_their_engine_with_the_draft_vocabulary(checkpoint):
    from dsv3.infer.cli import _describe, build_engine

    folder, _ = checkpoint
    if not (folder / dv.FILE).exists():
        dv.write(folder, list(range(300)), torch.ones(300, dtype=torch.int64), "test")
    engine = build_engine(str(folder), "auto", "native", "auto", "mtp", draft_vocab=16)
    assert engine.draft_vocab.k == 16 and "16-token draft vocabulary" in _describe(engine)


def test_draft_vocab_help_reads_well_at_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["draft-vocab", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--data" in out and all(len(line) <= 80 for line in out.splitlines())


def test_a_head_the_kernels_cannot_read_gives_the_same_draft_logits():
    model = tiny_model(vocab=300)
    h = torch.randn(1, model.config.hidden_size)
    vocab = DraftVocab([5, 1, 250], 300)
    want = model.mtp_logits(0, h)[:, [5, 1, 250]]
    model.lm_head.register_forward_hook(lambda module, args, out: out)  # the fast path then calls the module
    torch.testing.assert_close(vocab.logits(FastDecode(model), 0, h), want)


def test_mtp_speedup_benchmark_runs_with_draft_vocabularies(checkpoint, tmp_path, monkeypatch, capsys):
    """benchmarks/mtp_speedup.py end to end on the tiny checkpoint (it used to stop at loading the tokenizer)."""
    import importlib.util

    folder, _ = checkpoint
    if not (folder / dv.FILE).exists():
        dv.write(folder, list(range(300)), torch.ones(300, dtype=torch.int64), "test")
    (tmp_path / "prompts.txt").write_text("the cat sat\nhello world\n")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "mtp_speedup.py"
    spec = importlib.util.spec_from_file_location("mtp_speedup", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["mtp_speedup", "--model", str(folder), "--prompt-file",
                                      str(tmp_path / "prompts.txt"), "--prompts", "2", "--new-tokens", "6",
                                      "--draft-vocab", "16,64", "--json"])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["temperature"], r["draft_vocab"]) for r in rows] == [(t, k) for t in (0.0, 0.7) for k in (None, 16, 64)]
    assert all(r["greedy_outputs_identical"] for r in rows if r["temperature"] == 0)


def test_verify_computes_target_rows_only_when_it_reads_them():
    """A function for p gives verify's result for the stacked rows, same random stream, and after a
    rejection the row after the draft is never made (it costs a vocabulary sort with top-p)."""
    torch.manual_seed(0)
    params = SamplingParams(1.0, top_p=0.9)
    logits = torch.randn(2, 50) * 2
    full = probabilities(logits, params)
    asked = []

    def target(i):
        asked.append(i)
        return probabilities(logits[i : i + 1], params)[0]

    rejected = 0
    for seed in range(200):
        q = probabilities(torch.randn(1, 50) * 2, params)
        draft = int(torch.multinomial(q[0], 1, generator=torch.Generator().manual_seed(seed)))
        asked.clear()
        lazy = verify(target, q, [draft], torch.Generator().manual_seed(seed))
        assert lazy == verify(full, q, [draft], torch.Generator().manual_seed(seed))
        assert asked == ([0] if lazy[1] == 0 else [0, 1])
        rejected += lazy[1] == 0
    assert 0 < rejected < 200
