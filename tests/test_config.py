"""ModelConfig: both rope layouts, presets equal the shared configs, one message per problem."""

import json
from pathlib import Path

import pytest

from dsv3.cli import main
from dsv3.config import ModelConfig, preset
from dsv3.errors import DSV3Error

CONFIGS = Path(__file__).parents[1] / "src" / "dsv3" / "configs"


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2", "deepseek-v2-lite"])
def test_public_presets_carry_every_field_of_the_shipped_config(name):
    shipped = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = preset(name)
    for key, value in shipped.items():
        if key == "rope_scaling":
            assert cfg.rope_scaling.factor == value["factor"]
            assert cfg.rope_scaling.mscale_all_dim == value["mscale_all_dim"]
        elif hasattr(cfg, key):
            assert getattr(cfg, key) == value, key
    assert cfg.to_dict()["rope_scaling"]["original_max_position_embeddings"] == 4096


def test_old_and_new_rope_layouts_read_the_same():
    cfg = preset("deepseek-v3")
    new = cfg.to_dict(rope_layout="new")
    assert "rope_scaling" not in new and new["rope_parameters"]["rope_type"] == "yarn"
    assert new["rope_parameters"]["rope_theta"] == 10000
    assert ModelConfig.from_dict(new) == cfg == ModelConfig.from_dict(cfg.to_dict(rope_layout="old"))


def test_written_config_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    preset("deepseek-v3").save_json(tmp_path / "config.json")
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "deepseek_v3" and hf.topk_group == 4
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 40


def test_each_problem_gets_its_own_message():
    cfg = ModelConfig(n_routed_experts=10, n_group=3, topk_group=4, qk_rope_head_dim=63, topk_method="fastest",
                      scoring_func="relu")
    problems = cfg.problems()
    for phrase in ("not divisible by n_group", "topk_group (4) > n_group (3)", "must be even",
                   "unknown topk_method 'fastest'", "unknown scoring_func 'relu'"):
        assert sum(phrase in p for p in problems) == 1, phrase
    few = ModelConfig(n_routed_experts=16, n_group=8, topk_group=1, num_experts_per_tok=4)
    assert any("fewer than num_experts_per_tok" in p for p in few.problems())
    with pytest.raises(DSV3Error, match="invalid model config"):
        few.validate()


def test_malformed_config_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(DSV3Error, match="not valid JSON"):
        ModelConfig.from_json(bad)
    with pytest.raises(DSV3Error, match="unknown preset"):
        preset("gpt-5")


def test_cli_help_and_unknown_command(capsys):
    assert main([]) == 0
    assert "convert" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_unknown_flag_is_one_usage_error_not_a_traceback(capsys):
    assert main(["convert", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "No such option: --bogus" in err and "Traceback" not in err
