"""A tiny byte-level tokenizer with DeepSeek-V3's special tokens (role, end and tool-call markers), for tests
of chat, tool calls and structured output on tiny random models."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_tokenizer  # noqa: E402

SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>"]


def deepseek_tokenizer(vocab: int = 300):
    """``vocab`` ids in all: byte-level BPE below, DeepSeek's special tokens at the top."""
    tok = tiny_tokenizer(vocab - len(SPECIAL))
    tok.add_special_tokens(SPECIAL)
    assert tok.get_vocab_size() <= vocab
    return tok
