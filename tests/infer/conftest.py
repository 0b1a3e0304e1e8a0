"""Tiny random models and a tiny byte-level tokenizer, built in memory in well under a second."""

import pytest
import torch

from dsv3.config import preset
from dsv3.model import Transformer

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world, hello model",
          "User: hi\nAssistant: hello", "numbers 1 2 3 4 5 6 7 8 9"] * 4


def tiny_model(vocab: int = 300, layers: int = 2, gain: float = 4.0, seed: int = 0) -> Transformer:
    """nano-shaped (MLA + MoE + one MTP layer) with random weights scaled so that logits are not flat."""
    cfg = preset("nano").replace(vocab_size=vocab, num_hidden_layers=layers, eos_token_id=None)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(gain)
    return model


def decisive_routing(model: Transformer) -> Transformer:
    """The routers' selection biases set a whole unit apart (sigmoid scores span less than one), so every
    token picks the same experts by the bias alone; the gates still come from its own scores.

    Why: a random model's top-k scores are often within bf16 rounding of each other, so two bf16 paths that
    round in different places (the fast path's kernels, the module path's bf16 matmuls) can pick different
    experts for a token, and a decode step then moves that token's logits by several percent. Tests that
    compare such paths logit for logit use this; the fp32 variants keep data-dependent routing."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randperm(bias.numel(), generator=generator).to(bias.dtype))
    return model


def tiny_tokenizer(vocab: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def long_model():
    """The tiny model with a context of 2048 positions (its weights do not depend on it)."""
    net = tiny_model()
    net.config = net.config.replace(max_position_embeddings=2048)
    return net


def cached_prefix_engine(model: Transformer, prompt: list[int], speculative: bool):
    """(an Engine over ``model`` whose prefix cache holds ``prompt``'s first 192 tokens in 12 blocks of 16, the
    greedy 12 tokens a whole prefill of ``prompt`` gives) for tests of what a cached prefix leaves to prefill."""
    from dsv3.infer.engine import Engine, Request
    from dsv3.infer.prefix_cache import PrefixCache
    from dsv3.infer.sampling import GREEDY

    engine = Engine(model, speculative=speculative, eos_token_ids=frozenset())
    want = engine.generate([Request(prompt, 12, GREEDY)])[0].token_ids
    PrefixCache.for_engine(engine, 1 << 30)
    engine.generate([Request(prompt[:200] + [1, 2, 3], 2, GREEDY)])
    return engine, want


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(params=["fp32 FMAs", "bf16 dots"])
def bf16_path(request):
    """Both ways the decode kernels compute bf16 times bf16 (the GEMVs of bf16 activations by bf16 weights, the
    attention over a bf16 cache): AVX2 FMAs in fp32, or AVX512-BF16 dot products where the CPU has them
    (skipped elsewhere). Restores the process's setting after the test."""
    from dsv3.kernels import decode_kernels as dk

    on = dk.bf16_dots()
    if request.param == "bf16 dots" and not on:
        pytest.skip("the CPU lacks AVX512-BF16 (or the kernels are not built)")
    dk.bf16_dots(request.param == "bf16 dots")
    try:
        yield request.param
    finally:
        dk.bf16_dots(on)
