"""benchmarks/serve_vs_vllm.py without vLLM or servers: bad options end with one `error:` line before
anything starts, the server and client command lines it builds, the table and verdict it prints, and the
checkpoint it writes (loadable by dsv3 and transformers, in a shape vLLM's CPU MLA accepts)."""

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).parents[2] / "benchmarks" / "serve_vs_vllm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_vs_vllm", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def fake_vllm(tmp_path):
    """An executable file where the benchmark expects vLLM's python (never run here)."""
    path = tmp_path / "vllm"
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("argv, message", [
    (["--cores", "a-b"], "--cores must be a core range such as 0-1, got 'a-b'"),
    (["--cores", "1-0"], "--cores: the range '1-0' ends before it starts"),
    (["--cores", "0-4096"], "--cores 0-4096: this machine has cores 0-"),
    (["--concurrency", "1,x"], "--concurrency must be comma-separated integers, got '1,x'"),
    (["--concurrency", "0,8"], "--concurrency must list integers >= 1"),
    (["--servers", "dsv3,sglang"], "--servers: choose among dsv3, dsv3-passive, vllm, got dsv3,sglang"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--prompt-len", "2000", "--new-tokens", "64"], "--prompt-len + --new-tokens must be at most 2048"),
    (["--vllm-python", "/nonexistent/bin/python"], "--vllm-python /nonexistent/bin/python: not an executable (run: "
                                                    "bash benchmarks/vllm_cpu_setup.sh)"),
])
def test_bad_options_end_with_one_error_line_before_anything_starts(bench, fake_vllm, capsys, monkeypatch, argv,
                                                                     message):
    monkeypatch.setattr(bench, "measure", lambda args: pytest.fail("started despite a bad option"))
    assert bench.main(["--vllm-python", str(fake_vllm), *argv]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1 and lines[0].startswith(f"error: {message}")


def test_both_servers_get_the_same_cores_and_the_client_the_same_prompts(bench, fake_vllm):
    args = bench.parse_args(["--vllm-python", str(fake_vllm), "--cores", "0-1", "--concurrency", "1,8"])
    assert args.cores == [0, 1] and args.concurrency == [1, 8] and args.servers == ["dsv3", "dsv3-passive", "vllm"]
    dsv3, dsv3_env = bench.server_command("dsv3", Path("/ckpt/v3-random"), args, 8123)
    assert dsv3[1:] == ["-m", "dsv3", "serve", "--model", "/ckpt/v3-random", "--port", "8123", "--threads", "2",
                        "--quiet"]
    assert dsv3_env == {"OMP_NUM_THREADS": "2"}
    passive, passive_env = bench.server_command("dsv3-passive", Path("/ckpt/v3-random"), args, 8123)
    assert passive == dsv3 and passive_env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    vllm, vllm_env = bench.server_command("vllm", Path("/ckpt/v3-random"), args, 8124)
    assert vllm[:5] == [str(fake_vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", "/ckpt/v3-random"]
    assert vllm[vllm.index("--served-model-name") + 1] == bench.MODEL_NAME == "v3-random"
    assert vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    client = bench.bench_command("http://127.0.0.1:8124", 8, args, seed=1008)
    assert client[1:4] == ["-m", "dsv3", "bench"] and client[-1] == "--json"
    flags = dict(zip(client[5:-1:2], client[6:-1:2], strict=True))
    assert flags == {"--url": "http://127.0.0.1:8124", "--model": "v3-random", "--concurrency": "8",
                     "--requests": "32", "--prompt-len": "256", "--new-tokens": "64", "--vocab-size": "16371",
                     "--seed": "1008"}


def _row(server: str, r: int, c: int, tps: float) -> dict:
    return {"server": server, "round": r, "concurrency": c, "completed": 4 * c, "errors": 0,
            "output_tokens_per_s": tps, "tpot_ms": {"p50": 1000 / tps, "p99": 2000 / tps},
            "ttft_ms": {"p50": 50.0 + r, "p99": 90.0}}


def test_each_figure_is_the_best_round_and_the_verdict_compares_tokens_per_s(bench):
    rows = [_row("dsv3", 0, 1, 100.0), _row("dsv3", 1, 1, 125.0), _row("vllm", 0, 1, 120.0),
            _row("vllm", 1, 1, 110.0), _row("dsv3", 0, 8, 300.0), _row("dsv3", 1, 8, 280.0),
            _row("vllm", 0, 8, 380.0), _row("vllm", 1, 8, 400.0)]
    best = bench.best_rows(rows, [1, 8])
    assert {k: (v["round"], v["output_tokens_per_s"]) for k, v in best.items()} == {
        "dsv3_c1": (1, 125.0), "vllm_c1": (0, 120.0), "dsv3_c8": (0, 300.0), "vllm_c8": (1, 400.0)}
    ratios = bench.verdict(best, [1, 8])
    assert ratios["c1"]["held"] and not ratios["c8"]["held"]
    assert ratios["c8"]["dsv3_over_vllm"] == pytest.approx(0.75)
    assert bench.table_lines(best, [1, 8], ["dsv3", "vllm"]) == [
        "| server | concurrency | output tokens/s | TPOT p50 / p99 (ms) | TTFT p50 (ms) |",
        "|---|---|---|---|---|",
        "| dsv3 | 1 | 125.0 | 8.0 / 16.0 | 51.0 |",
        "| vllm | 1 | 120.0 | 8.3 / 16.7 | 50.0 |",
        "| dsv3 | 8 | 300.0 | 3.3 / 6.7 | 50.0 |",
        "| vllm | 8 | 400.0 | 2.5 / 5.0 | 51.0 |"]
    assert bench.verdict_lines(ratios) == [
        "concurrency 1: dsv3 at 1.04x vLLM's output tokens/s: goal held",
        "concurrency 8: dsv3 at 0.75x vLLM's output tokens/s: goal not held"]


def test_a_server_with_no_completed_round_shows_dashes_and_no_verdict(bench):
    rows = [_row("dsv3", 0, 1, 100.0), {**_row("vllm", 0, 1, 1.0), "completed": 0}]
    best = bench.best_rows(rows, [1])
    assert bench.table_lines(best, [1], ["dsv3", "vllm"])[-1] == "| vllm | 1 | - | - | - |"
    assert bench.verdict(best, [1]) == {}


def test_the_checkpoint_loads_in_dsv3_and_transformers_in_a_shape_vllm_accepts(bench, tmp_path):
    from transformers import AutoTokenizer

    from dsv3.checkpoint import load_pretrained
    from dsv3.config import ModelConfig
    from dsv3.data.chat_template import load_chat_template
    from dsv3.data.tokenizer import load_tokenizer_folder

    folder = tmp_path / "v3-random"
    bench.write_checkpoint(folder, layers=1)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["topk_method"] == "noaux_tc" and raw["scoring_func"] == "sigmoid"
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["torch_dtype"] == "bfloat16"
    assert raw["kv_lora_rank"] + raw["qk_rope_head_dim"] in (320, 512, 576)
    assert all(raw[k] % 32 == 0 for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    cfg = ModelConfig.from_json(folder)
    model = load_pretrained(folder)
    assert cfg.num_hidden_layers == 1 and cfg.num_nextn_predict_layers == 0
    assert sum(p.numel() for p in model.parameters()) > 0 and next(model.parameters()).dtype.is_floating_point

    ours = load_tokenizer_folder(folder)
    assert ours.tokenizer.get_vocab_size() == cfg.vocab_size
    assert (ours.bos_id, ours.eos_id) == (cfg.bos_token_id, cfg.eos_token_id)
    hf = AutoTokenizer.from_pretrained(folder)
    assert len(hf) == cfg.vocab_size and hf.eos_token_id == cfg.eos_token_id
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 2 + 2?<｜Assistant｜>"
    template = load_chat_template(folder, ours.tokenizer)
    assert template.render(messages, add_generation_prompt=True) == text
    assert hf.decode(hf.encode("hello world", add_special_tokens=False)) == "hello world"



def test_a_client_that_fails_becomes_one_error_naming_the_server(bench, fake_vllm):
    from dsv3.errors import DSV3Error

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = bench.parse_args(["--vllm-python", str(fake_vllm)])
    with pytest.raises(DSV3Error) as failure:
        bench.bench(f"http://127.0.0.1:{port}", 1, args, seed=0)
    assert str(failure.value).startswith(f"dsv3 bench serve against http://127.0.0.1:{port} failed: cannot reach "
                                         f"a server at http://127.0.0.1:{port}: ")
    assert "\n" not in str(failure.value)
