"""Gradient accumulation equals one big batch; bf16, fp8 and the simulated MoE combine train; a
non-finite loss skips the step and, repeated, stops the run with a usable checkpoint."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import dsv3
from dsv3.errors import DSV3Error
from dsv3.model.transformer import Transformer
from dsv3.train.run import run_training


def _losses(opts, **kw):
    rows = []
    run_training(opts, on_step=rows.append, show_progress=False, plots=False, **kw)
    return rows


def test_grad_accumulation_matches_the_full_batch(make_opts):
    one = _losses(make_opts("one", steps=3, batch_size=4, grad_accum=1))
    two = _losses(make_opts("two", steps=3, batch_size=4, grad_accum=2))
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["expert_load"] == b["expert_load"]


@pytest.mark.parametrize(
    "extra", [dict(precision="bf16"), dict(precision="fp8"), dict(moe_output_format="logfmt8")]
)
def test_low_precision_variants_train(make_opts, extra):
    ref = _losses(make_opts("ref", steps=4))
    rows = _losses(make_opts("variant", steps=4, **extra))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert losses != [r["loss"] for r in ref]  # the variant really computes differently
    assert losses[0] == pytest.approx(ref[0]["loss"], abs=0.05)  # ... but close to fp32


def test_fp8_keeps_the_output_head_high_precision(tiny_config):
    from dsv3.config import load_config
    from dsv3.precision.fp8_linear import FP8Linear
    from dsv3.train.precision import apply_fp8

    model = Transformer(load_config(str(tiny_config)))
    converted = apply_fp8(model)
    assert type(model.lm_head) is nn.Linear
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in converted
    assert isinstance(model.model.layers[1].mlp.shared_experts.down_proj, FP8Linear)
    assert not any(
        isinstance(m, nn.Linear) and not isinstance(m, FP8Linear)
        for name, m in model.named_modules()
        if name != "lm_head"
    )


def test_non_finite_loss_skips_then_stops_with_a_usable_checkpoint(make_opts, monkeypatch):
    real_loss = Transformer.loss
    calls = {"n": 0}

    def poisoned(self, input_ids, labels, ignore_index=-100):
        out = real_loss(self, input_ids, labels, ignore_index)
        calls["n"] += 1
        if calls["n"] == 3 or calls["n"] >= 5:  # step 3 once, then steps 5, 6, 7 in a row
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Transformer, "loss", poisoned)
    opts = make_opts(steps=10, save_every=4, eval_every=100, max_bad_steps=3)
    rows = []
    with pytest.raises(DSV3Error, match="non-finite for 3 steps in a row"):
        run_training(opts, on_step=rows.append, show_progress=False, plots=False)
    assert [r["skipped"] for r in rows] == [False, False, True, False, True, True, True]
    assert rows[2]["lr"] > 0 and rows[3]["loss"] is not None
    monkeypatch.setattr(Transformer, "loss", real_loss)
    at_4 = dsv3.load_pretrained(opts.out + "/checkpoints/step-000004")
    at_7 = dsv3.load_pretrained(opts.out + "/latest")
    assert os.path.realpath(opts.out + "/latest").endswith("step-000007")  # saved on the way out
    for (name, a), b in zip(at_4.state_dict().items(), at_7.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the skipped steps changed nothing
    assert all(torch.isfinite(t).all() for t in at_7.state_dict().values())
