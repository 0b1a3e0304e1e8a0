"""benchmarks/serve_scaling.py without servers: its checks refuse bad options before any process starts
(one `error:` line, exit status 2), its command lines, and its result table and figure."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).parents[2] / "benchmarks" / "serve_scaling.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_scaling", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "ep4-prefill4"], "--layouts: 'ep4-prefill4': P must be between 1 and N - 1"),
    (["--layouts", "tp2"], "--layouts: 'tp2' is not 1, epN or epN-prefillP"),
    (["--layouts", "1,1"], "--layouts must name at least one layout, each once"),
    (["--concurrency", "1,x"], "--concurrency must be comma-separated integers, got '1,x'"),
    (["--concurrency", "0,2"], "--concurrency must list integers >= 1, got '0,2'"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt: no such folder"),
    (["--preset", "huge"], "unknown preset 'huge'; choose one of "),
    (["--figure", "/nonexistent/dir/f.png"], "/nonexistent/dir/f.png: its folder does not exist"),
])
def test_bad_options_end_with_one_error_line_before_any_process_starts(bench, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(bench, "benchmark", lambda args: pytest.fail("started despite a bad option"))
    assert bench.main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 1 and lines[0].startswith(f"error: {message}")


def test_layouts_and_their_server_commands(bench):
    args = bench.parse_args(["--layouts", "ep4-prefill2,1,ep4", "--concurrency", "8,1,2"])
    assert [lay.name for lay in args.layouts] == ["ep4-prefill2", "1", "ep4"]
    assert args.concurrency == [1, 2, 8]
    assert args.json_out == args.figure.with_suffix(".json")
    one, disagg = bench.server_command(bench.Layout(), "M", 1, 8), bench.server_command(bench.Layout(4, 2), "M", 1, 8)
    assert one[1:] == ["-m", "dsv3", "serve", "--model", "M", "--port", "0", "--quiet", "--threads", "1",
                       "--max-batch", "8"]
    assert disagg[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]
    assert disagg[-4:] == ["--ep", "4", "--prefill-ranks", "2"]


def _run(layout: str, c: int, tps: float, ttft: float | None, errors: int = 0) -> dict:
    ms = {"mean": None, "p50": ttft, "p99": None if ttft is None else 2 * ttft}
    return {"layout": layout, "concurrency": c, "completed": 4 - errors, "errors": errors,
            "request_throughput": tps / 10, "output_tokens_per_s": tps, "ttft_ms": ms, "tpot_ms": ms}


def test_points_are_medians_over_rounds_and_the_table_and_figure_show_them(bench, tmp_path):
    layouts = [bench.Layout(), bench.Layout(4)]
    rows = [_run("1", 1, 10.0, 50.0), _run("1", 1, 30.0, 70.0), _run("1", 1, 20.0, None, errors=1),
            _run("ep4", 1, 5.0, 200.0, errors=4)]
    points = bench.summarize(rows, layouts, [1])
    assert [(p["label"], p["rounds"], p["output_tokens_per_s"], p["ttft_p50_ms"], p["ttft_p99_ms"], p["errors"])
            for p in points] == [("1 process", 3, 20.0, 60.0, 120.0, 1), ("--ep 4", 1, 5.0, 200.0, 400.0, 4)]
    assert bench.table(points) == [
        "| layout | C | req/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | failed |",
        "|---|---|---|---|---|---|---|",
        "| `1 process` | 1 | 2.00 | 20.0 | 60 / 120 | 60 / 120 | 1 |",
        "| `--ep 4` | 1 | 0.50 | 5.0 | 200 / 400 | 200 / 400 | 4 |",
    ]
    figure = tmp_path / "f.png"
    bench.draw(points, figure, "title")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))


def test_sigterm_unwinds_like_ctrl_c(bench):
    """A `kill` (or a CI timeout) must run the finally blocks that stop the servers."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        bench._terminate_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
    finally:
        signal.signal(signal.SIGTERM, before)
