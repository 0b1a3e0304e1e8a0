"""benchmarks/decode_speed.py on the nano shape: its batch section's bounds (bytes alone, then bytes and
multiply-adds) and its text report, and one error line for an unknown section."""

import json
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).parents[2] / "benchmarks" / "decode_speed.py"


def run(*flags):
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=600)


def test_batch_section_reports_its_speedup_beside_both_bounds():
    flags = ["--preset", "nano", "--threads", "1", "--new-tokens", "2", "--repeats", "1", "--batch", "4",
             "--batch-context", "64", "--batch-weights", "bf16", "--sections", "batch,weights"]
    done = run(*flags, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["weights"]["bf16"] < result["weights"]["fp32"]
    (row,) = result["batch"]
    assert (row["weights"], row["context"], row["threads"]) == ("bf16", 64, 1)
    assert row["batch_over_1"] == row["batch 4"]["tokens_per_s"] / row["batch 1"]["tokens_per_s"]
    # four tokens read the dense weights once: bytes allow more than 1x, never more than 4x
    assert 1 < row["bound_over_1"] <= 4
    # multiply-adds can only lower that bound; nano's token costs over a million of them
    assert 1 <= row["compute_bound_over_1"] <= row["bound_over_1"]
    assert row["fmas_per_token"] > 1e6 and row["fma_rate_per_s"] > 1e8
    # the attention's share, counted at the rate of its own arithmetic (bf16 dot products, where they run)
    assert 0 < row["attention_fmas_per_token"] < row["fmas_per_token"] and row["attention_rate_per_s"] > 1e8
    text = run(*flags)
    assert text.returncode == 0, text.stderr
    assert "batch bf16: " in text.stdout and "bytes and multiply-adds" in text.stdout


def test_an_unknown_section_ends_with_one_error_line():
    bad = run("--sections", "batch,speed")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == (
        "decode_speed.py: error: --sections must list some of batch1,batch,mtp,overhead,weights,cache, "
        "got 'batch,speed'")


def test_an_unknown_row_to_skip_or_shape_ends_with_one_error_line():
    bad = run("--skip", "transformers,llama")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == (
        "decode_speed.py: error: --skip must list some of transformers,module, got 'llama,transformers'")
    bad = run("--preset", "huge")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1].startswith("decode_speed.py: error: unknown preset 'huge'")


def test_the_large_shape_is_past_a_last_level_cache():
    """``--preset large``: at least 1.5 GB of fp32 weights (the issue's floor), most of them routed experts."""
    sys.path.insert(0, str(BENCH.parent))
    import decode_speed
    from dsv3.model import Transformer

    with torch.device("meta"):
        model = Transformer(decode_speed.shape("large"))
    total = sum(p.numel() for p in model.parameters()) * 4
    experts = sum(p.numel() for moe in model.moe_layers() for p in moe.experts.parameters()) * 4
    assert total >= 1.5e9 and experts > 0.8 * total
