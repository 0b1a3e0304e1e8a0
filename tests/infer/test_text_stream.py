"""TextStream (incremental detokenization over a window of the newest ids) against its definition: the text
of all ids decoded at once, released only where it can no longer change, cut at the first stop string."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dsv3.infer.detok import TextStream

from .conftest import tiny_tokenizer


def byte_pieces() -> Tokenizer:
    """A byte-level BPE whose pieces are single bytes and random pairs of them: random ids split characters
    across tokens and make invalid UTF-8 (as a random model's output does), plus special tokens."""
    rng = random.Random(0)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(alphabet)}
    merges = []
    while len(vocab) < 400:
        left, right = rng.choice(alphabet), rng.choice(alphabet)
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True), AddedToken("<|tool|>", special=True)])
    return tok


def sentence_pieces() -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace): the decoder drops the leading space of the first word,
    so a token's text depends on whether a word comes before it."""
    words = ["[UNK]", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁a", "s", "ing", "▁"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


TOKENIZERS = {"byte-level BPE": byte_pieces, "trained BPE": tiny_tokenizer, "metaspace": sentence_pieces}


def definition(tok: Tokenizer, ids: list[int], stops: tuple[str, ...], skip: bool = True) -> tuple[str, bool]:
    """The whole text and whether it stopped: all ids decoded at once, cut before the first stop string."""
    text = tok.decode(ids, skip_special_tokens=skip)
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def streamed(stream: TextStream, ids: list[int]) -> tuple[list[str], bool]:
    """The deltas released token by token, until a stop string completes or the ids end (then flushed)."""
    deltas = []
    for token in ids:
        delta, hit = stream.push(token)
        deltas.append(delta)
        if hit:
            return deltas, True
    return [*deltas, stream.flush()], False


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_the_released_text_is_the_whole_decode(name, skip):
    tok = TOKENIZERS[name]()
    rng = random.Random(1)
    for _ in range(40):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 60))]
        deltas, _ = streamed(TextStream(tok, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_strings_cut_where_the_whole_text_first_holds_one(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(2)
    for _ in range(40):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(2, 60))]
        text = tok.decode(ids)
        at = rng.randrange(len(text)) if text else 0
        stops = (text[at : at + rng.randrange(1, 4)], "\u2603never")
        deltas, hit = streamed(TextStream(tok, stops), ids)
        assert ("".join(deltas), hit) == definition(tok, ids, stops)


def test_text_is_held_back_while_a_character_is_incomplete():
    """The euro sign's three bytes as three tokens: nothing until the last, then the whole character."""
    tok = byte_pieces()
    ids = [_byte_id(tok, b) for b in "€".encode()]
    stream = TextStream(tok)
    assert [stream.push(i)[0] for i in ids] == ["", "", "€"]


def test_a_tail_that_may_grow_into_a_stop_string_waits():
    tok = sentence_pieces()
    ids = tok.encode("the cat").ids
    stream = TextStream(tok, ("cat sat",))
    assert [stream.push(i)[0] for i in ids] == ["the", " "]  # "cat" could still become "cat sat"
    assert stream.flush() == "cat"


def test_a_long_generation_decodes_a_window_not_the_whole_sequence():
    """The cost per token must not grow with the tokens before it: count the ids each decode call reads."""
    tok = byte_pieces()
    read = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            read.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(3)
    ascii_ids = [_byte_id(tok, b) for b in b"abcdefghij"]
    stream = TextStream(Counting())
    for _ in range(2000):
        stream.push(rng.choice(ascii_ids))
    assert max(read) <= 4 and len(stream.text) == 2000


def test_state_and_restore_go_on_as_one_stream():
    tok = byte_pieces()
    rng = random.Random(4)
    ids = [rng.randrange(tok.get_vocab_size()) for _ in range(50)]
    first = TextStream(tok)
    deltas = [first.push(i)[0] for i in ids[:25]]
    second = TextStream(tok)
    second.restore(first.state())
    deltas += [second.push(i)[0] for i in ids[25:]] + [second.flush()]
    assert "".join(deltas) == tok.decode(ids)


def _byte_id(tok: Tokenizer, byte: int) -> int:
    """The id of the piece that is this one byte."""
    piece = next(c for c, b in _byte_level_table().items() if b == byte)
    return tok.token_to_id(piece)


def _byte_level_table() -> dict[str, int]:
    from dsv3.infer.detok import _byte_level_decoder

    return _byte_level_decoder()
