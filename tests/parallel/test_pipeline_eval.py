"""Held-out evaluation under `--pp` runs through the pipeline stages (forward only, the loss at the last
stage, broadcast): every rank gets the one process's loss, and no rank gathers the whole model."""

from __future__ import annotations

import pytest

from dsv3.config import ModelConfig
from dsv3.testing.launch import launch
from dsv3.testing.pipeline_eval_scenarios import one_process_nats, pipeline_eval_worker

# 4 layers, 3 of them MoE with 32 experts: about 80 MB in fp32, so a gathered copy shows in VmHWM.
CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=32,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  num_nextn_predict_layers=0, rope_scaling=None).validate()


@pytest.fixture(scope="module")
def reference() -> float:
    return one_process_nats(CFG)


def test_pipeline_eval_gives_one_process_loss_without_gathering_the_model(reference):
    ranks = launch(pipeline_eval_worker, 2, (CFG, False), timeout_s=240)
    model_bytes = sum(r["held"] for r in ranks)  # the stages hold disjoint parameters (no MTP: nothing tied)
    for r in ranks:
        assert r["nats"] == pytest.approx(reference, rel=1e-6)  # every rank logs the same value
        assert r["grown"] < 0.6 * model_bytes, (r["grown"], model_bytes)  # measured: 14-29 MB of 81 MB


def test_the_memory_bound_tells_a_gathered_model_apart(reference):
    """The same measurement on the old way (the whole model gathered on every rank) exceeds the bound:
    what the first test measures would show a gather."""
    ranks = launch(pipeline_eval_worker, 2, (CFG, True), timeout_s=240)
    model_bytes = sum(r["held"] for r in ranks)
    for r in ranks:
        assert r["nats"] == pytest.approx(reference, rel=1e-6)
        assert r["grown"] > model_bytes, (r["grown"], model_bytes)  # measured: 325 MB (copies in transit)
