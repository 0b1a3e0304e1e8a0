"""The tokenizer a run trains with, and the token streams of both splits, cached.

dsv3's own (``--tokenizer dsv3``): a byte-level BPE trained with the `tokenizers` library, cached by corpus
and vocabulary. Token ids 0 and 1 are the special ``<|begin_of_text|>`` and ``<|end_of_text|>`` (the ids
DeepSeek's config names as bos/eos); every document in a stream is followed by ``<|end_of_text|>``. A
checkpoint carries ``tokenizer.json`` plus ``tokenizer_config.json``, so ``transformers.AutoTokenizer``
and ``PreTrainedTokenizerFast(tokenizer_file=...)`` both load it.

A checkpoint's (``--tokenizer DIR``): its ``tokenizer.json``, the BOS/EOS its ``tokenizer_config.json``
names (each text document becomes BOS + text + EOS) and its chat template; the run's checkpoints carry
copies of its files. Chat records are the template's tokens, with a mask of the tokens the loss covers
(``dsv3.data.chat_sft``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv3.data.chat_sft import chat_tokens
from dsv3.data.chat_template import (
    NAMED_TEMPLATES_DIR,
    TEMPLATE_FILE,
    ChatTemplate,
    load_chat_template,
    special_tokens,
)
from dsv3.data.corpus import Corpus, Document
from dsv3.errors import DSV3Error
from dsv3.io import atomic_path, atomic_write_text

BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
TOKENIZER_RECIPE = "bytelevel-bpe-v1"  # bump when the recipe changes, so old caches are not reused
STREAM_RECIPE = "streams-v2"  # likewise for the token streams (v2: BOS, chat records and their masks)
ENCODE_CHUNK_DOCS = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", TEMPLATE_FILE)
OWN = "dsv3"  # --tokenizer's name for dsv3's own BPE


@dataclass
class TrainingTokenizer:
    """The tokenizer of a run and how documents become tokens with it: each text document is
    ``bos_id`` (when set) + its ids + ``eos_id``; a chat record is ``template``'s rendering. ``folder``:
    the checkpoint folder it came from (its files are copied into the run's checkpoints), None for
    dsv3's own BPE."""

    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None
    template: ChatTemplate
    folder: Path | None = None

    def save(self, folder: Path, model_max_length: int) -> None:
        """The tokenizer files a checkpoint carries, so `dsv3 serve` and transformers load it."""
        if self.folder is None:
            save_tokenizer_files(self.tokenizer, folder, model_max_length)
        else:
            copy_tokenizer_files(self.folder, folder)


def own_tokenizer(tokenizer: Tokenizer) -> TrainingTokenizer:
    """dsv3's own BPE: no BOS, ``<|end_of_text|>`` after each document, the plain chat template."""
    return TrainingTokenizer(tokenizer, tokenizer.token_to_id(EOS_TOKEN), None, load_chat_template(None, tokenizer))


def load_tokenizer_folder(folder: str | Path) -> TrainingTokenizer:
    """A checkpoint's tokenizer (``--tokenizer DIR``): tokenizer.json, the BOS/EOS of tokenizer_config.json,
    the chat template beside them."""
    path = Path(folder)
    if not path.is_dir():
        raise DSV3Error(f"--tokenizer {folder}: no such folder (or --tokenizer {OWN} for dsv3's own BPE)")
    if not (path / "tokenizer.json").is_file():
        raise DSV3Error(f"--tokenizer {folder}: the folder has no tokenizer.json; --tokenizer {OWN} trains dsv3's "
                        "own BPE on the data instead")
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise DSV3Error(f"{path / 'tokenizer.json'} is not a tokenizer file: {exc}") from None
    named = special_tokens(path)
    ids = {key: tokenizer.token_to_id(named[key]) if key in named else None for key in ("bos_token", "eos_token")}
    if ids["eos_token"] is None:
        raise DSV3Error(f"--tokenizer {folder}: tokenizer_config.json names no eos_token that tokenizer.json "
                        "holds; documents need one to end")
    return TrainingTokenizer(tokenizer, ids["eos_token"], ids["bos_token"],
                             load_chat_template(path, tokenizer).checked(), path)


def copy_tokenizer_files(source: Path, folder: Path) -> None:
    """``source``'s tokenizer files (and chat templates) into ``folder``, byte for byte, file by file
    atomically."""
    names = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    names += [f"{NAMED_TEMPLATES_DIR}/{p.name}" for p in sorted((source / NAMED_TEMPLATES_DIR).glob("*.jinja"))]
    for name in names:
        target = Path(folder) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            tmp.write_bytes((source / name).read_bytes())


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
    specials = set(SPECIAL_TOKENS) | {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for token, idx in tokenizer.get_vocab().items():
        lengths[idx] = 0 if token in specials else len(token)
    return lengths


@dataclass
class TokenStreams:
    train: np.ndarray  # [n_train_tokens] ids, each document followed by EOS
    val: np.ndarray  # [n_val_tokens]
    eos_id: int
    train_mask: np.ndarray | None = None  # [n_train_tokens] bool: the tokens the loss covers (None: all)
    val_mask: np.ndarray | None = None


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer | TrainingTokenizer, cache_dir: Path) -> TokenStreams:
    """Both splits as token streams, cached as .npy (memory-mapped on reuse); with chat records, the
    masks of the tokens the loss covers beside them."""
    encoding = tokenizer if isinstance(tokenizer, TrainingTokenizer) else own_tokenizer(tokenizer)
    has_chat = any(d.chat is not None for d in corpus.train + corpus.val)
    templates = sorted(encoding.template.templates.items()) if has_chat else None
    key = _digest(STREAM_RECIPE, corpus.fingerprint, encoding.tokenizer.to_str(), encoding.bos_id, encoding.eos_id,
                  templates)
    folder = Path(cache_dir) / f"tokens-{key[:16]}"
    dtype = np.uint16 if encoding.tokenizer.get_vocab_size() <= 2**16 else np.int32
    streams = {}
    for split, docs in (("train", corpus.train), ("val", corpus.val)):
        path, mask_path = folder / f"{split}.npy", folder / f"{split}-mask.npy"
        if not path.exists():
            ids, mask = _encode_stream(encoding, docs, dtype)
            if has_chat:
                _atomic_save_npy(mask_path, mask)
            _atomic_save_npy(path, ids)  # last: its presence says the split is complete
        streams[split] = np.load(path, mmap_mode="r")
        streams[f"{split}_mask"] = np.load(mask_path, mmap_mode="r") if has_chat else None
    return TokenStreams(eos_id=encoding.eos_id, **streams)


def _encode_stream(encoding: TrainingTokenizer, docs: list[Document], dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids back to back, and the mask of the tokens the loss covers (every token of a
    text document; a chat's assistant tokens)."""
    ids, masks = [], []
    prefix = [] if encoding.bos_id is None else [encoding.bos_id]
    for start in range(0, len(docs), ENCODE_CHUNK_DOCS):
        chunk = docs[start : start + ENCODE_CHUNK_DOCS]
        texts = [d.text for d in chunk if d.chat is None]
        encoded = iter(encoding.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else ())
        for doc in chunk:
            if doc.chat is None:
                doc_ids = prefix + next(encoded).ids + [encoding.eos_id]
                doc_mask = np.ones(len(doc_ids), dtype=bool)
            else:
                try:
                    doc_ids, doc_mask = chat_tokens(encoding.tokenizer, encoding.template, doc.chat)
                except DSV3Error as exc:
                    raise DSV3Error(f"{doc.name}: {exc}") from None
            ids.append(np.asarray(doc_ids, dtype=dtype))
            masks.append(doc_mask)
    if not ids:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=bool)
    return np.concatenate(ids), np.concatenate(masks)


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
