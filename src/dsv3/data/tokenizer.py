"""Byte-level BPE trained with the `tokenizers` library, cached by corpus and vocabulary, and the
token streams of both splits, cached beside it.

Token ids 0 and 1 are the special ``<|begin_of_text|>`` and ``<|end_of_text|>`` (the ids DeepSeek's
config names as bos/eos); every document in a stream is followed by ``<|end_of_text|>``. A checkpoint
carries ``tokenizer.json`` plus ``tokenizer_config.json``, so ``transformers.AutoTokenizer`` and
``PreTrainedTokenizerFast(tokenizer_file=...)`` both load it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv3.data.corpus import Corpus, Document
from dsv3.errors import DSV3Error
from dsv3.io import atomic_path, atomic_write_text

BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
TOKENIZER_RECIPE = "bytelevel-bpe-v1"  # bump when the recipe changes, so old caches are not reused
ENCODE_CHUNK_DOCS = 256


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSV3_CACHE", Path.home() / ".cache" / "dsv3"))


def train_or_load_tokenizer(
    corpus: Corpus, vocab_size: int, cache_dir: Path, max_train_bytes: int = 16 * 2**20
) -> Tokenizer:
    """BPE trained on (a deterministic subset of at most ``max_train_bytes`` of) the training split;
    reused from ``cache_dir`` when the same corpus and vocabulary size were seen before."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DSV3Error(
            f"vocabulary size must be at least {256 + len(SPECIAL_TOKENS)} for a byte-level "
            f"BPE (256 bytes + special tokens), got {vocab_size}"
        )
    key = _digest(TOKENIZER_RECIPE, corpus.fingerprint, vocab_size, max_train_bytes)
    path = Path(cache_dir) / f"tokenizer-{key[:16]}" / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = _train_bpe(_training_subset(corpus.train, max_train_bytes), vocab_size)
    atomic_write_text(path, tokenizer.to_str())
    return tokenizer


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, "special tokens must take ids 0 and 1"
    return tokenizer


def _training_subset(docs: list[Document], max_bytes: int) -> list[str]:
    """Every k-th training document, k chosen so the subset is at most about ``max_bytes``."""
    total = sum(len(d.text) for d in docs)
    stride = max(1, -(-total // max_bytes))
    return [d.text for d in docs[::stride]]


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): the denominator of bits per byte.

    In a byte-level vocabulary each character of a token's string is one byte of the original text."""
    lengths = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    specials = set(SPECIAL_TOKENS)
    for token, idx in tokenizer.get_vocab().items():
        lengths[idx] = 0 if token in specials else len(token)
    return lengths


@dataclass
class TokenStreams:
    train: np.ndarray  # [n_train_tokens] ids, each document followed by EOS
    val: np.ndarray  # [n_val_tokens]
    eos_id: int


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path) -> TokenStreams:
    """Both splits as token streams, cached as .npy (memory-mapped on reuse)."""
    key = _digest(corpus.fingerprint, tokenizer.to_str())
    folder = Path(cache_dir) / f"tokens-{key[:16]}"
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.int32
    streams = {}
    for split, docs in (("train", corpus.train), ("val", corpus.val)):
        path = folder / f"{split}.npy"
        if not path.exists():
            _atomic_save_npy(path, _encode_stream(tokenizer, docs, eos_id, dtype))
        streams[split] = np.load(path, mmap_mode="r")
    return TokenStreams(train=streams["train"], val=streams["val"], eos_id=eos_id)


def _encode_stream(tokenizer: Tokenizer, docs: list[Document], eos_id: int, dtype) -> np.ndarray:
    parts = []
    for start in range(0, len(docs), ENCODE_CHUNK_DOCS):
        chunk = [d.text for d in docs[start : start + ENCODE_CHUNK_DOCS]]
        for enc in tokenizer.encode_batch(chunk, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(np.asarray([eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def save_tokenizer_files(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json into ``folder`` (atomically, file by file)."""
    folder = Path(folder)
    atomic_write_text(folder / "tokenizer.json", tokenizer.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)

def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode("utf-8") + b"\0")
    return h.hexdigest()
