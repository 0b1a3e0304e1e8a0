"""`dsv3 bench serve` against a real `dsv3 serve` process, and the serve command's prefix-cache flags."""

import json
import re
import socket

import pytest

from dsv3.cli import main
from dsv3.infer.bench_serve import base_url, percentile
from dsv3.testing.http import serve_process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-serve")
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def server_url(checkpoint, tmp_path_factory):
    """`python -m dsv3 serve --port 0` in its own process; its URL once it listens."""
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    with serve_process(["--model", str(checkpoint), "--threads", "1", "--quiet", "--prefix-cache-bytes", "64M"],
                       log) as url:
        yield url


def test_bench_serve_against_a_real_server(server_url, capsys):
    args = ["bench", "serve", "--url", server_url + "/v1/", "--concurrency", "2", "--requests", "6",
            "--prompt-len", "40", "--new-tokens", "5", "--shared-prefix", "32"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["completed"], r["errors"], r["url"]) == (6, 0, server_url)
    assert r["total_output_tokens"] == 6 * 5 and r["total_prompt_tokens"] == 6 * 40  # exact lengths
    # the first two run together and miss; each later one reuses the two shared blocks of 16 tokens
    assert r["cached_tokens"] >= 4 * 32 and r["cached_token_share"] == r["cached_tokens"] / 240
    for key in ("ttft_ms", "tpot_ms", "ttft_ms_cached", "ttft_ms_uncached"):
        assert 0 < r[key]["p50"] <= r[key]["p99"], key
    assert r["request_throughput"] > 0 and r["output_tokens_per_s"] > r["request_throughput"]

    assert main(args + ["--requests", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert any(line.startswith("TTFT p50 / p99:") for line in lines)
    assert any(re.match(r"Requests completed / failed:\s+2 / 0$", line) for line in lines)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("url", "message"), [
    ("http://127.0.0.1:{port}", "cannot reach a server at http://127.0.0.1:"),
    ("localhost:8000", "--url must look like http://HOST:PORT"),
    ("http://127.0.0.1:99999", "--url has a bad port"),
])
def test_bench_serve_with_no_server_is_one_clear_error(url, message, capsys):
    assert main(["bench", "serve", "--url", url.format(port=_closed_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


@pytest.mark.parametrize(("extra", "message"), [
    (["--shared-prefix", "50", "--prompt-len", "40"], "--shared-prefix (50) cannot exceed --prompt-len (40)"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--prompt-len", "2000", "--new-tokens", "100"], "exceeds the model's context (1024)"),
    (["--model", "gpt-9"], "does not serve 'gpt-9'; it serves tiny-serve"),
])
def test_bench_serve_bad_flags(server_url, extra, message, capsys):
    assert main(["bench", "serve", "--url", server_url, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--prefix-cache-bytes", "lots"], "--prefix-cache-bytes must be a size"),
    (["--prefix-cache-bytes", "0", "--prefix-cache-dir", "x"], "--prefix-cache-dir needs a prefix cache"),
    (["--prefix-block-tokens", "0"], "--prefix-block-tokens must be >= 1"),
])
def test_serve_prefix_cache_flags_are_checked(checkpoint, extra, message, capsys):
    assert main(["serve", "--model", str(checkpoint), "--port", "0", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_helpers():
    assert base_url("http://h:1/v1/") == "http://h:1" and base_url(" https://h/api/v1 ") == "https://h/api"
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
