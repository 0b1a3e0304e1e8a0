"""Shared fixtures for the training tests: a tiny V3 config (2 layers, 8 experts) and a tiny corpus,
so every run takes a fraction of a second per step on one CPU core."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dsv3.config import preset
from dsv3.train.options import TrainOptions

WORDS = (
    "the quick brown fox jumps over a lazy dog while def class return import print value "
    "for in range if else lambda yield"
).split()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest (and most predictably on a shared machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    cfg = preset("nano").replace(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg.save_json(path)
    return path


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(16):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(30))
        (root / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def make_opts(tiny_config, corpus_dir, cache_dir, tmp_path):
    def make(name: str = "run", **overrides) -> TrainOptions:
        base = dict(
            config=str(tiny_config),
            data=[str(corpus_dir)],
            out=str(tmp_path / name),
            steps=6,
            batch_size=4,
            seq_len=32,
            lr=3e-3,
            save_every=3,
            eval_every=3,
            eval_tokens=128,
            cache_dir=str(cache_dir),
            device="cpu",
            val_fraction=0.1,
        )
        base.update(overrides)
        return TrainOptions(**base)

    return make
