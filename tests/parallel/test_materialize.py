"""The trainer's meta build: a fresh model's every tensor is the value seeded by (run seed, its name), the
routed experts each by its own name, so any layout that materializes a share holds one process's values."""

from __future__ import annotations

import torch

from dsv3.config import preset
from dsv3.model.init import initial_value
from dsv3.train.distributed import World
from dsv3.train.options import TrainOptions
from dsv3.train.run import build_model


def test_a_fresh_models_tensors_are_seeded_by_their_names():
    cfg = preset("nano").replace(num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1)
    model = build_model(cfg, TrainOptions(seed=7), World(0, 1, 0, torch.device("cpu"))).model
    std = cfg.initializer_range
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            stacked, _, proj = name.rpartition(".")
            for e in range(t.shape[0]):  # each expert by its own name, as an EP rank holding it alone asks
                assert torch.equal(t[e], initial_value(f"{stacked}.{e}.{proj}", tuple(t.shape[1:]), std, 7)), name
        else:
            assert torch.equal(t, initial_value(name, tuple(t.shape), std, 7)), name
    assert model.model.norm.weight.eq(1).all() and model.inv_freq.isfinite().all()
    other = build_model(cfg, TrainOptions(seed=8), World(0, 1, 0, torch.device("cpu"))).model
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)  # the seed is applied
