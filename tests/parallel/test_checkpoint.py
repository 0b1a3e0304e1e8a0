"""The sharded checkpoint's per-piece rules in one process (no process group): keys are the whole model's
names with one key per routed expert, for the optimizer state too; a rank that holds some experts (in any
slots, one of them twice) loads exactly those, moments and step included; a checkpoint of another model or
a corrupt one is one clear error. (Every layout, on gloo processes: tests/train/test_train_reshard.py.)"""

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.model import Transformer
from dsv3.parallel.checkpoint import checkpoint_state, load_state, save_state, whole_model
from dsv3.testing.ep_scenarios import tiny_config


def trained(seed: int = 0, layers: int = 2) -> tuple[Transformer, torch.optim.Optimizer]:
    """A tiny model after one AdamW step (so that every parameter has moments and a step count)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(2).replace(num_hidden_layers=layers)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    model.loss(ids, ids).loss.backward()
    optimizer.step()
    return model, optimizer


def test_keys_are_the_whole_models_names_one_per_expert_and_views_of_the_live_tensors():
    model, optimizer = trained()
    state = checkpoint_state(model, optimizer)
    experts = model.model.layers[1].mlp.experts
    key = "model.layers.1.mlp.experts.3.gate_proj"
    assert state["model/" + key].data_ptr() == experts.gate_proj[3].data_ptr()  # a view: nothing copied
    assert torch.equal(state[f"optim/{key}.exp_avg"], optimizer.state[experts.gate_proj]["exp_avg"][3])
    assert state["optim/model.layers.1.mlp.experts.0.gate_proj.step"] == 1 and f"optim/{key}.step" not in state
    assert not [k for k in state if k.endswith("experts.gate_proj") or ".experts.gate_proj." in k]
    assert "model/model.layers.1.mlp.gate.e_score_correction_bias" in state  # the router biases travel too
    n_experts = model.config.n_routed_experts
    assert sum(k.startswith("model/model.layers.1.mlp.experts.") for k in state) == 3 * n_experts


def test_a_rank_holding_some_experts_loads_exactly_them(tmp_path):
    model, optimizer = trained(seed=0)
    save_state(tmp_path / "dcp", model, optimizer)

    other, _ = trained(seed=1)
    held = torch.tensor([5, 2, 5])  # an EP rank's slots; expert 5 twice (a redundant copy)
    for moe in other.moe_layers():
        moe.experts = moe.experts.select(held)
        moe.dispatcher.expert_ids = held  # what an expert-parallel dispatcher names
    fresh = torch.optim.AdamW(other.parameters(), lr=1e-2, fused=True)
    load_state(tmp_path / "dcp", other, fresh, list(other.parameters()))

    for moe, ref in zip(other.moe_layers(), model.moe_layers(), strict=True):
        for name in ("gate_proj", "up_proj", "down_proj"):
            got, want = getattr(moe.experts, name), getattr(ref.experts, name)
            assert torch.equal(got, want[held])
            assert torch.equal(fresh.state[got]["exp_avg_sq"], optimizer.state[want]["exp_avg_sq"][held])
            assert fresh.state[got]["step"] == 1
        assert torch.equal(moe.gate.e_score_correction_bias, ref.gate.e_score_correction_bias)
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert torch.equal(fresh.state[other.lm_head.weight]["exp_avg"], optimizer.state[model.lm_head.weight]["exp_avg"])


def test_whole_model_reads_back_the_saved_model(tmp_path):
    model, optimizer = trained()
    save_state(tmp_path / "dcp", model, optimizer)
    again = whole_model(tmp_path / "dcp", model.config)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_another_model_or_a_corrupt_one_is_one_clear_error(tmp_path):
    model, optimizer = trained(layers=2)
    save_state(tmp_path / "dcp", model, optimizer)
    bigger, opt3 = trained(layers=3)
    with pytest.raises(DSV3Error, match="lacks .* tensor\\(s\\) of this model .*saved from another model"):
        load_state(tmp_path / "dcp", bigger, opt3, list(bigger.parameters()))
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(DSV3Error, match="cannot read the sharded checkpoint"):
        load_state(tmp_path / "dcp", model, optimizer, list(model.parameters()))
