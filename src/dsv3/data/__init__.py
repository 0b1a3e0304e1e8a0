"""Training data: a corpus of documents, a byte-level BPE tokenizer trained on it, and packed sequences.

``load_corpus`` finds the documents (the running Python's standard library by default) and splits off a
held-out set by a hash of each document's name; ``train_or_load_tokenizer`` trains (or reuses from the
cache) a BPE tokenizer on the training split; ``tokenize_corpus`` turns both splits into cached token
streams with an end-of-document token after each document; ``PackedSequences`` cuts a stream into
fixed-length windows served in a seed-determined order that can resume at any sample.
"""

from dsv3.data.corpus import Corpus, Document, load_corpus
from dsv3.data.packing import PackedSequences, SampleOrder
from dsv3.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    TokenStreams,
    save_tokenizer_files,
    token_byte_lengths,
    tokenize_corpus,
    train_or_load_tokenizer,
)

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "Corpus",
    "Document",
    "PackedSequences",
    "SampleOrder",
    "TokenStreams",
    "load_corpus",
    "save_tokenizer_files",
    "token_byte_lengths",
    "tokenize_corpus",
    "train_or_load_tokenizer",
]
