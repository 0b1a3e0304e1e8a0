"""benchmarks/decode_speed.py on the nano shape: its batch section's bounds (bytes alone, then bytes and
multiply-adds) and its text report, and one error line for an unknown section."""

import json
import os
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


def test_avx2_runs_the_kernels_avx2_paths_or_says_why_it_cannot():
    """``--avx2``: the run is on the kernels' AVX2 paths and says so; without the C kernels, one error line."""
    flags = ["--avx2", "--preset", "nano", "--threads", "1", "--new-tokens", "2", "--repeats", "1", "--batch", "2",
             "--batch-context", "32", "--batch-weights", "bf16", "--sections", "batch", "--json"]
    done = run(*flags)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["simd"] == "avx2" and result["bf16_dots"] is False and result["amx"] is False
    assert result["batch"][0]["batch_over_1"] > 0
    off = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DSV3_DECODE_KERNELS": "0"})
    assert off.returncode == 2 and off.stdout == ""
    assert off.stderr.strip().splitlines()[-1].startswith(
        "decode_speed.py: error: --avx2 measures the C kernels, which do not run here: ")


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


def test_fp8_step_bytes_count_the_attention_copy_of_kv_b_as_the_decode_path_makes_it():
    """An FP8 model's kv_b_proj is read by the attention as a bf16 copy (W_UK, W_UV), not as FP8 blocks: the
    bound's bytes per step count that copy's bytes in their place (and no scales), and the other tensors as
    stored; a bf16 model reads kv_b in place."""
    sys.path.insert(0, str(BENCH.parent))
    import decode_speed
    from dsv3.config import preset
    from dsv3.infer.fp8_weights import to_fp8_weights
    from dsv3.kernels.decode import AttentionPlan
    from dsv3.model import Transformer
    from dsv3.model.mla import MLA

    torch.manual_seed(0)
    bf16 = Transformer(preset("nano")).to(torch.bfloat16).eval()
    assert decode_speed.read_as_copies(bf16) == {}
    fp8 = to_fp8_weights(Transformer(preset("nano")).to(torch.bfloat16).eval())
    copies = decode_speed.read_as_copies(fp8)
    mlas = [m for m in fp8.modules() if isinstance(m, MLA)]  # the main layers' and the MTP layer's
    assert len(mlas) == len(fp8.main_layers) + len(fp8.mtp_layers) and len(copies) == 2 * len(mlas)
    for mla in mlas:
        plan, kv_b = AttentionPlan(mla, torch.bfloat16), mla.kv_b_proj
        assert copies[id(kv_b.weight_fp8)] == plan.w_uk.nbytes + plan.w_uv.nbytes == kv_b.weight_fp8.numel() * 2
        assert copies[id(kv_b.weight_scale_inv)] == 0
    main = [layer.self_attn.kv_b_proj for layer in fp8.main_layers]
    with_copies = decode_speed.weight_bytes_per_token(fp8)
    decode_speed.read_as_copies, keep = (lambda model: {}), decode_speed.read_as_copies
    try:
        as_stored = decode_speed.weight_bytes_per_token(fp8)
    finally:
        decode_speed.read_as_copies = keep
    assert with_copies - as_stored == sum(kv.weight_fp8.numel() * 2 - kv.weight_fp8.nbytes - kv.weight_scale_inv.nbytes
                                          for kv in main)
