"""A frequency-ranked draft vocabulary for MTP speculation (FR-Spec, Zhao et al. 2025; EAGLE-3's draft
vocabulary does the same).

The MTP draft's output head reads the whole ``vocab x hidden`` head a second time every step: on the
``small`` shape that is a third of a plain step's bytes. Restricted to the K tokens most frequent in a
corpus, the draft head reads K/V of it. Exactness does not depend on the draft: greedy verification
keeps a draft only when it is the target's argmax, and with sampling the draft distribution q is a
proper distribution over the K tokens (zero elsewhere), which rejection sampling accepts as any other q.
A draft outside the K tokens is never proposed; the target still emits it (at the cost of a rejected
draft), so the restriction moves acceptance, never the output.

``dsv3 draft-vocab --model DIR`` counts the tokens of a corpus (by default the Python standard library,
what ``dsv3 train`` learns from) with the checkpoint's tokenizer and writes every token id of the
model's vocabulary, most frequent first, to ``DIR/draft_vocab.json``. ``--draft-vocab K`` (generate,
chat, serve) then drafts over the first K of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from dsv3.errors import DSV3Error
from dsv3.io import atomic_write_text, require_regular_file

FILE = "draft_vocab.json"
FORMAT = "dsv3-draft-vocab"


def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int, batch: int = 256) -> torch.Tensor:
    """How often each token id in [0, vocab_size) occurs in ``texts`` (int64 [vocab_size]); ids the
    tokenizer gives past ``vocab_size`` are an error (the checkpoint and its tokenizer disagree)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            _add_counts(counts, tokenizer, chunk)
            chunk = []
    if chunk:
        _add_counts(counts, tokenizer, chunk)
    return counts


def _add_counts(counts: torch.Tensor, tokenizer, texts: list[str]) -> None:
    ids = torch.tensor([i for enc in tokenizer.encode_batch(texts) for i in enc.ids], dtype=torch.int64)
    if ids.numel() and int(ids.max()) >= counts.numel():
        raise DSV3Error(f"the tokenizer gives token id {int(ids.max())}, outside the model's vocabulary of "
                        f"{counts.numel()}: the tokenizer does not belong to this checkpoint")
    counts += torch.bincount(ids, minlength=counts.numel())


def ranked(counts: torch.Tensor) -> list[int]:
    """Every token id, most frequent first; equal counts in id order (so the file is reproducible)."""
    return torch.sort(-counts, stable=True).indices.tolist()


def coverage(counts: torch.Tensor, ids: list[int], k: int) -> float:
    """The share of the counted tokens that the first k ranked ids cover."""
    total = int(counts.sum())
    return float(counts[ids[:k]].sum()) / total if total else 0.0


def write(folder: str | Path, ids: list[int], counts: torch.Tensor, corpus: str) -> Path:
    """Write ``folder/draft_vocab.json`` atomically (an interrupted run never leaves half a file that a later
    ``--draft-vocab`` would read)."""
    path = Path(folder) / FILE
    doc = {"format": FORMAT, "vocab_size": len(ids), "corpus": corpus, "tokens_counted": int(counts.sum()),
           "ids": ids, "counts": counts[ids].tolist()}
    try:
        atomic_write_text(path, json.dumps(doc, separators=(",", ":")))
    except OSError as exc:
        raise DSV3Error(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def load(folder: str | Path, k: int, vocab_size: int) -> torch.Tensor:
    """The first ``k`` ranked ids of ``folder/draft_vocab.json`` (int64 [k]), checked against the model's
    vocabulary: a missing, unreadable or foreign file, or k out of [1, vocab_size], is a DSV3Error."""
    if not 1 <= k <= vocab_size:
        raise DSV3Error(f"--draft-vocab must be in [1, {vocab_size}] (the model's vocabulary), got {k}")
    path = Path(folder) / FILE
    if not path.exists():
        raise DSV3Error(f"--draft-vocab needs {path}: write it with `dsv3 draft-vocab --model {folder}`")
    require_regular_file(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DSV3Error(f"cannot read {path}: {exc}") from None
    ids = doc.get("ids") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(ids, list):
        raise DSV3Error(f"{path} is not a draft vocabulary (no \"format\": \"{FORMAT}\" with \"ids\"); "
                        f"write it again with `dsv3 draft-vocab --model {folder}`")
    if doc.get("vocab_size") != vocab_size:
        raise DSV3Error(f"{path} ranks a vocabulary of {doc.get('vocab_size')} tokens, the model has {vocab_size}; "
                        f"write it again with `dsv3 draft-vocab --model {folder}`")
    return checked_ids(ids[:k], vocab_size, str(path), k)


def checked_ids(ids, vocab_size: int, where: str, k: int | None = None) -> torch.Tensor:
    """``ids`` as int64 [n] when they are k (or any number >= 1) distinct token ids in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple, torch.Tensor)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in (ids.tolist() if torch.is_tensor(ids) else ids)):
        raise DSV3Error(f"{where}: the draft vocabulary must be a list of integer token ids")
    t = torch.as_tensor(ids, dtype=torch.int64).flatten()
    if k is not None and t.numel() < k:
        raise DSV3Error(f"{where} ranks only {t.numel()} token ids, fewer than --draft-vocab {k}")
    if t.numel() == 0:
        raise DSV3Error(f"{where}: the draft vocabulary is empty")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise DSV3Error(f"{where}: token ids outside the vocabulary [0, {vocab_size})")
    if torch.unique(t).numel() != t.numel():
        raise DSV3Error(f"{where}: the draft vocabulary repeats token ids")
    return t


class DraftVocab:
    """The draft head restricted to ``ids`` (int64 [K]): logits for those K tokens only, and the full
    distribution q they stand for. The head's K rows are gathered once into a contiguous K x hidden copy
    (per head module), so the GEMV reads them in place like any other weight."""

    def __init__(self, ids: torch.Tensor, vocab_size: int):
        self.ids = checked_ids(ids, vocab_size, "the draft vocabulary")
        self.vocab_size = vocab_size
        self._rows: tuple[torch.Tensor, object] | None = None  # (the head's weight tensor, its gathered Weight)

    @property
    def k(self) -> int:
        return self.ids.numel()

    def head_weight(self, w):
        """The kernels' view (``decode_kernels.Weight``) of the rows ``ids`` of the head ``w`` (a Weight, or
        None for a head the kernels cannot read: then None), made once per head tensor. An FP8-block head's
        rows are gathered dequantized (its 128-row scale blocks do not survive a row gather): the values the
        full head computes with, in its compute dtype."""
        from dsv3.kernels.decode_kernels import Weight

        if w is None:
            return None
        if self._rows is None or self._rows[0] is not w.w:
            self._rows = (w.w, Weight(w.dense().index_select(0, self.ids.to(w.w.device)).contiguous()))
        return self._rows[1]

    def restrict(self, full_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] -> the draft vocabulary's [..., K] (the reference path)."""
        return full_logits.index_select(-1, self.ids.to(full_logits.device))

    def logits(self, decoder, depth: int, h_mtp: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K] from the MTP layer's hidden states: through ``FastDecode.mtp_logits`` with
        the gathered head, or the model's full head then the K columns (the readable path, same values)."""
        from dsv3.kernels.decode import FastDecode

        if isinstance(decoder, FastDecode):
            return decoder.mtp_logits(depth, h_mtp, vocab=self)
        return self.restrict(decoder.mtp_logits(depth, h_mtp))

    def token(self, j: int) -> int:
        """The vocabulary id of the draft vocabulary's j-th token."""
        return int(self.ids[j])

    def spread(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the K tokens [K] as one over the whole vocabulary [V] (zero elsewhere)."""
        return torch.zeros(self.vocab_size, dtype=q.dtype).index_copy_(0, self.ids, q)
