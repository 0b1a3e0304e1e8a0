"""Test-wide settings: one torch thread (tiny models run faster without intra-op threading, and the
suite shares two cores), and the tiny training config several test folders use."""

import pytest
import torch

from dsv3.config import ModelConfig, preset

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_train_config() -> ModelConfig:
    """nano's structure at toy size (2 layers, 8 experts in 2 groups): a training step takes milliseconds."""
    return preset("nano").replace(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=128,
    )


DEEPSEEK_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
HF_TOKENIZER_TEXT = (
    "You are a helpful assistant. What is the weather in Paris today? It is sunny and 21 degrees. "
    "Call get_weather with the city. {\"city\": \"Paris\", \"unit\": \"celsius\"} Thanks! Answer in JSON.\n"
)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A factory: ``make(chat_template=None, name=...)`` -> a folder written by transformers'
    ``save_pretrained`` holding a tiny byte-level BPE tokenizer with DeepSeek's special tokens (ids 0..12,
    BOS and EOS first), with ``chat_template`` set when given (a string or a dict of named templates),
    saved as .jinja files or, with ``jinja_files=False``, inside tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def make(chat_template=None, name="tok", jinja_files=True):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(DEEPSEEK_SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([HF_TOKENIZER_TEXT] * 4, trainer=trainer)
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=DEEPSEEK_SPECIAL_TOKENS[0],
                                     eos_token=DEEPSEEK_SPECIAL_TOKENS[1], chat_template=chat_template)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder, save_jinja_files=jinja_files)
        return folder

    return make
