"""benchmarks/decode_attention.py on the nano shape: every attention path the CPU has (FMAs, bf16 dots, AMX
tiles) timed and their errors reported against fp32 arithmetic, and one error line for a bad option."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3.kernels import decode_kernels as dk
from dsv3.kernels import int_weights as iw

BENCH = Path(__file__).parents[2] / "benchmarks" / "decode_attention.py"


def run(*flags):
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not (dk.kernels_available() and dk.bf16_dots()), reason="needs AVX512-BF16")
def test_every_path_is_timed_and_their_errors_ordered():
    flags = ["--preset", "nano", "--contexts", "64,200", "--repeats", "1", "--draws", "3", "--batch", "2"]
    done = run(*flags, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    paths = ["fp32 FMAs", "bf16 dots"] + (["AMX tiles"] if dk.amx() else [])
    assert result["paths"] == paths and result["batch"] == 2
    assert [(r["context"], r["threads"]) for r in result["speed"]] == [(64, 1), (200, 1)]
    for r in result["speed"]:
        us = r["us_per_call"]
        assert list(us) == paths and all(t > 0 for t in us.values())
        assert r["dots_speedup"] == us["fp32 FMAs"] / us["bf16 dots"]
        assert ("amx_speedup" in r) == ("AMX tiles" in paths)
        if "AMX tiles" in paths:
            assert r["amx_speedup"] == us["bf16 dots"] / us["AMX tiles"]
    for r in result["accuracy"]:
        e = {name: v["max"] for name, v in r["relative_error"].items()}
        # fp32 FMAs: only the output's bf16 rounding; the dots round more; against their own rounded
        # queries only the softmax weights' rounding is left
        assert e["fp32 FMAs"] < 5e-3 and e["bf16 dots vs bf16 queries"] < 5e-3 and e["bf16 dots"] < 5e-2
        if "AMX tiles" in paths:  # the dots' roundings, summed in another order
            assert e["AMX tiles vs bf16 queries"] < 5e-3 and e["AMX tiles"] < 5e-2
        assert r["relative_error"]["fp32 FMAs"]["median"] < r["relative_error"]["bf16 dots"]["median"]
    text = run(*flags)
    assert text.returncode == 0, text.stderr
    assert "bf16 dots" in text.stdout and "module path" in text.stdout


def test_a_bad_context_list_ends_with_one_error_line():
    bad = run("--contexts", "256,zero")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1].startswith("decode_attention.py: error: --contexts")


@pytest.mark.skipif(not (dk.kernels_available() and iw.avx512(True)), reason="needs AVX-512F")
def test_the_fp32_cache_paths_are_timed_and_agree():
    done = run("--preset", "nano", "--cache", "fp32", "--contexts", "200", "--repeats", "1", "--draws", "2",
               "--batch", "3", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["cache"] == "fp32" and result["paths"] == ["AVX2 FMAs", "AVX-512 FMAs"]
    (r,) = result["speed"]
    assert r["avx512_speedup"] == r["us_per_call"]["AVX2 FMAs"] / r["us_per_call"]["AVX-512 FMAs"]
    assert "dots_speedup" not in r and "amx_speedup" not in r
    errors = result["accuracy"][0]["relative_error"]
    assert set(errors) == {"AVX2 FMAs", "AVX-512 FMAs", "module path"}
    assert errors["AVX2 FMAs"]["max"] < 1e-5 and errors["AVX-512 FMAs"]["max"] < 1e-5  # fp32 sums in two orders
