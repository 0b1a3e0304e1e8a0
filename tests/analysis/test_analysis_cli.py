"""`dsv3 analyze` and `dsv3 paper` through the real dispatcher: JSON, Markdown, plots, clear errors."""

import json

import pytest

from dsv3.cli import main


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_json_has_the_required_keys(capsys):
    code, out, _ = run(capsys, "analyze", "--preset", "deepseek-v3", "--json", "--hardware", "h800")
    assert code == 0
    report = json.loads(out)  # exactly one JSON object on stdout
    assert report["total_params"] == 671_026_419_200
    assert report["active_params"] == 37_552_297_472
    assert report["kv_bytes_per_token"] == 70_272
    assert round(report["train_flops_per_token"] / 1e9) == 250
    assert report["meta_check"]["agrees"] is True
    assert report["hardware"][0]["hardware"] == "h800"
    assert report["mtp"]["speedup"] == pytest.approx(1.8)


def test_analyze_options_change_the_figures(capsys):
    _, out, _ = run(capsys, "analyze", "--preset", "llama-3.1-405b", "--json", "--cache-dtype", "fp8",
                    "--context", "1000", "--batch", "3", "--seq-len", "8192", "--hardware", "m4-max")
    r = json.loads(out)
    assert r["kv_bytes_per_token"] == 516_096 and r["kv_bytes_per_token_at_kv_dtype"] == 516_096 / 2
    assert r["kv_cache"]["bytes"] == 516_096 / 2 * 1000 * 3
    assert r["ep_bound"] is None and r["seq_len"] == 8192


def test_analyze_a_user_config_and_hardware_file(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}))
    hw = tmp_path / "box.json"
    hw.write_text(json.dumps({"name": "box", "memory_gb": 96, "memory_bandwidth_gbs": 960, "bf16_tflops": 50}))
    code, out, _ = run(capsys, "analyze", "--config", str(tmp_path), "--json", "--hardware", str(hw))
    r = json.loads(out)
    assert code == 0 and r["model"]["attention"] == "gqa" and "meta_check" not in r
    assert r["total_params"] / 1e9 == pytest.approx(46.70, abs=0.01)
    assert r["ep_bound"]["comm_time_s"] == pytest.approx(3 * 32 * 2 * 4096 / 50e9)
    assert r["hardware"][0]["tps"] == pytest.approx(960e9 / r["hardware"][0]["bytes_per_token"])


def test_analyze_markdown_and_terminal(capsys):
    code, out, _ = run(capsys, "analyze", "--preset", "deepseek-v2-lite", "--markdown", "--hardware", "m4-pro")
    assert code == 0 and "## Parameters by category" in out and "| m4-pro |" in out
    code, out, _ = run(capsys, "analyze", "--preset", "nano", "--hardware", "h100")
    assert code == 0 and "Training cost" in out


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"model_type": "gpt2", "n_embd": 768}), "unsupported model_type 'gpt2'"),
    (json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
                 "intermediate_size": 128}), "lacks 'num_attention_heads'"),
    (json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
                 "intermediate_size": 128, "num_attention_heads": 6, "num_key_value_heads": 4}), "multiple"),
    (json.dumps({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
                 "intermediate_size": 128, "num_attention_heads": 4, "num_local_experts": 2,
                 "num_experts_per_tok": 3}), "exceeds"),
    (json.dumps({"model_type": "deepseek_v3", "hidden_size": -5}), "hidden_size must be a positive integer"),
    (json.dumps({"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2, "vocab_size": 10,
                 "intermediate_size": 128, "num_attention_heads": 4}), "positive integer"),
])
def test_malformed_or_unsupported_config_exits_2(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, out, err = run(capsys, "analyze", "--config", str(path), "--json")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--preset", "gpt-5"], "unknown preset"),
    ([], "exactly one of"),
    (["--preset", "nano", "--config", "x.json"], "exactly one of"),
    (["--preset", "nano", "--cache-dtype", "fp7"], "unknown dtype"),
    (["--preset", "nano", "--json", "--markdown"], "one of --json and --markdown"),
    (["--config", "/nonexistent/config.json"], "not found"),
    (["--preset", "nano", "--mfu", "2"], "MFU"),
])
def test_bad_flags_exit_2(capsys, args, message):
    code, out, err = run(capsys, "analyze", *args)
    assert code == 2 and out == "" and message in err


def test_paper_json_and_markdown(capsys):
    code, out, _ = run(capsys, "paper", "--json")
    rows = json.loads(out)["rows"]
    assert code == 0 and len(rows) >= 30
    by_quantity = {r["quantity"]: r for r in rows}
    assert by_quantity["TPOT, 61 layers, 50 GB/s"]["ours"] == pytest.approx(14.757, abs=1e-3)
    assert {"paper", "ours", "diff_pct", "note", "unit", "group"} <= set(rows[0])
    code, out, _ = run(capsys, "paper", "--markdown")
    assert code == 0 and "| LLaMA-3.1 405B | 7.28 | 7.34426 |" in out and "## Table 2" in out


def test_plots_are_written(capsys, tmp_path):
    code, out, err = run(capsys, "analyze", "--preset", "deepseek-v2", "--json", "--hardware", "h800",
                         "--plot-dir", str(tmp_path / "plots"))
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert code == 0 and names == ["active_vs_total.png", "kv_cache_vs_context.png", "tpot_vs_bandwidth.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert len(json.loads(out)["plots"]) == 3 and "wrote" in err
