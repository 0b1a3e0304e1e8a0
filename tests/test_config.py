"""ModelConfig: both rope layouts, presets equal the shared configs, one message per problem."""

import contextlib
import dataclasses
import json
import os
import threading
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


# ---- defaults per model_type, types, bounds (issue 16) ------------------------------------------

@pytest.mark.parametrize("model_type, hf_class", [("deepseek_v2", "DeepseekV2Config"),
                                                  ("deepseek_v3", "DeepseekV3Config")])
def test_missing_fields_take_the_model_types_transformers_defaults(model_type, hf_class):
    """A config.json that leaves a field out means what transformers' config class says it means."""
    transformers = pytest.importorskip("transformers")
    ours = ModelConfig.from_dict({"model_type": model_type})
    hf = getattr(transformers, hf_class)()
    compared = [f.name for f in dataclasses.fields(ours)
                if hasattr(hf, f.name) and f.name not in ("rope_scaling", "torch_dtype", "extra")]
    assert len(compared) > 25
    for name in compared:
        assert getattr(ours, name) == getattr(hf, name), name
    # what the modeling code does regardless of config: V2 softmax/greedy without MTP, V3 sigmoid/noaux_tc
    expected = {"deepseek_v2": ("softmax", "greedy", 0), "deepseek_v3": ("sigmoid", "noaux_tc", 1)}[model_type]
    assert (ours.scoring_func, ours.topk_method, ours.num_nextn_predict_layers) == expected


def _write_config(tmp_path, **changes) -> Path:
    data = preset("nano").to_dict()
    for key, value in changes.items():
        if value is _DROP:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


_DROP = object()
BAD_FIELDS = [
    (dict(n_group="4"), "n_group must be an integer or null, got '4'"),
    (dict(topk_group=2.0), "topk_group must be an integer or null, got 2.0"),
    (dict(num_hidden_layers=None), "num_hidden_layers must be an integer, got null"),
    (dict(max_position_embeddings=None), "max_position_embeddings must be an integer, got null"),
    (dict(hidden_size=[128]), "hidden_size must be an integer, got [128]"),
    (dict(hidden_size=True), "hidden_size must be an integer, got true"),
    (dict(rope_scaling="yarn"), "rope_scaling must be an object or null, got 'yarn'"),
    (dict(rope_parameters=[1]), "rope_parameters must be an object or null"),
    (dict(rope_scaling={"type": "yarn", "factor": "4"}), "rope_scaling.factor must be a number, got '4'"),
    (dict(rope_scaling={"type": "linear", "factor": 4}), "rope scaling type 'linear' is not supported"),
    (dict(n_shared_experts=-1), "n_shared_experts must be >= 0, got -1"),
    (dict(vocab_size=2**63), "vocab_size = 9223372036854775808 exceeds dsv3's limit"),
    (dict(n_routed_experts=10**12), "n_routed_experts = 1000000000000 exceeds dsv3's limit"),
    (dict(num_hidden_layers=10**12), "num_hidden_layers = 1000000000000 exceeds dsv3's limit"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be finite"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor must be a number"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    (dict(scoring_func=1), "scoring_func must be a string, got 1"),
    (dict(eos_token_id="1"), "eos_token_id must be a token id, a list of token ids or null"),
    (dict(eos_token_id=[1, -2]), "eos_token_id must be a token id"),
    (dict(model_type="llama"), "unsupported model_type 'llama'"),
    (dict(rope_interleave=False), "rope_interleave false"),
    (dict(quantization_config={"quant_method": "awq"}), "only DeepSeek's FP8 scheme"),
    (dict(model_type="deepseek_v2", scoring_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.0),
     "is ambiguous"),
]


@pytest.mark.parametrize("changes, message", BAD_FIELDS)
def test_bad_field_is_one_line_naming_it(tmp_path, changes, message):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(DSV3Error) as err:
        ModelConfig.from_json(path)
    text = str(err.value)
    assert message in text and "\n" not in text and text.startswith(str(path))


def test_bad_fields_through_the_cli_exit_2_with_one_error_line(tmp_path, capsys):
    for changes, message in BAD_FIELDS[:6] + BAD_FIELDS[11:14]:
        path = _write_config(tmp_path, **changes)
        assert main(["analyze", "--config", str(path), "--json"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_absurd_sizes_of_other_families_are_refused_by_the_analyzer(tmp_path, capsys):
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 10**6, "vocab_size": 10,
             "intermediate_size": 128, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    assert main(["analyze", "--config", str(tmp_path / "config.json"), "--json"]) == 2
    assert "num_hidden_layers = 1000000 exceeds dsv3's limit of 1,024" in capsys.readouterr().err


def test_eos_token_id_list_is_valid_and_round_trips(tmp_path):
    path = _write_config(tmp_path, eos_token_id=[1, 7])
    cfg = ModelConfig.from_json(path)
    assert cfg.eos_token_ids == frozenset({1, 7})
    cfg.save_json(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["eos_token_id"] == [1, 7]
    assert ModelConfig.from_json(_write_config(tmp_path, eos_token_id=None)).eos_token_ids == frozenset()


def test_null_norm_topk_prob_reads_as_false_and_a_v3_config_without_mtp_key_has_one(tmp_path):
    cfg = ModelConfig.from_json(_write_config(tmp_path, norm_topk_prob=None, num_nextn_predict_layers=_DROP))
    assert cfg.norm_topk_prob is False and cfg.num_nextn_predict_layers == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_config_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "config.json")  # opening it for reading would block until a writer comes
    done = threading.Event()

    def writer():  # should the reader block, release it after 5 s: the test then fails instead of hanging
        done.wait(5)
        while not done.is_set():
            with contextlib.suppress(OSError):
                os.close(os.open(tmp_path / "config.json", os.O_WRONLY | os.O_NONBLOCK))
            done.wait(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with pytest.raises(DSV3Error, match="is not a regular file"):
            ModelConfig.from_json(tmp_path)
        with pytest.raises(DSV3Error, match="is not a regular file"):
            ModelConfig.from_json("/dev/zero")
    finally:
        done.set()
        thread.join()
