"""The limited-precision accumulation emulator and `dsv3 study accumulation`."""

import json

import numpy as np
import pytest
import typer

from dsv3.errors import DSV3Error
from dsv3.precision import accumulation as acc
from dsv3.studies import accumulation as study


def test_bits_below_the_13th_fraction_bit_of_the_largest_term_are_truncated():
    products = np.array([[1.0, 2.0**-13, 2.0**-14, 3 * 2.0**-15]])
    got = acc.limited_dot(products, group=4)
    assert got[0] == 1.0 + 2.0**-13  # 2**-14 and 3*2**-15 fall off the 13-bit window


def test_truncation_is_toward_zero_for_negative_sums():
    products = np.array([[-1.0, -(2.0**-14)], [-1.0, 2.0**-14]])
    got = acc.limited_dot(products, group=2)
    assert got.tolist() == [-1.0, -1.0]


def test_accumulator_joins_the_alignment_only_when_asked():
    # group 1: the running sum 1.0 is already there when the tiny product arrives
    products = np.array([[1.0, 2.0**-14, 2.0**-14]])
    assert acc.limited_dot(products, group=1)[0] == 1.0
    # aligned among themselves, the two tiny products survive (2**-13 total) and then hit FP22
    got = acc.limited_dot(products, group=1, align_with_accumulator=False)
    assert got[0] == 1.0  # ... and are truncated when added to the 14-bit accumulator one by one
    small_first = np.array([[2.0**-14, 2.0**-14, 1.0, 0.0]])
    together = acc.limited_dot(small_first, group=2, align_with_accumulator=False)
    assert together[0] == 1.0 + 2.0**-13  # summed in their own group first, they now register


def test_wide_fraction_reproduces_the_exact_sum():
    rng = np.random.default_rng(0)
    a = acc.fp8_random((16, 2048), "normal", rng)
    b = acc.fp8_random((16, 2048), "normal", rng)
    exact = (a * b).sum(axis=1)
    got = acc.limited_dot(a * b, fraction_bits=50, promote_every=None)
    np.testing.assert_allclose(got, exact, rtol=1e-12)


def test_fp8_inputs_are_e4m3_values():
    values = acc.fp8_random((4, 256), "uniform", np.random.default_rng(1))
    assert values.max() <= 448 and values.min() >= 0
    mantissa, _ = np.frexp(values[values > 2.0**-6])  # normal E4M3 numbers: 1 + 3 fraction bits
    assert np.all((mantissa * 16) == np.round(mantissa * 16))


def test_no_promotion_error_grows_with_k_and_is_percent_level_at_4096():
    errors = {k: acc.relative_errors(k, 64, "uniform").max() for k in (512, 4096)}
    assert errors[4096] > 4 * errors[512]
    assert 0.01 < errors[4096] < 0.2


def test_promotion_every_128_cuts_the_error_by_two_orders_of_magnitude():
    none = acc.relative_errors(4096, 64, "uniform", None).max()
    by_nc = {nc: acc.relative_errors(4096, 64, "uniform", nc).max() for nc in (32, 128, 512)}
    assert by_nc[32] < by_nc[128] < by_nc[512] < none
    assert by_nc[128] < 2e-3 and none / by_nc[128] > 50


def test_bad_promotion_interval_is_rejected():
    with pytest.raises(DSV3Error, match="multiple"):
        acc.limited_dot(np.ones((1, 64)), promote_every=48)
    with pytest.raises(DSV3Error, match="distribution"):
        acc.relative_errors(64, 2, "cauchy")


def run_cli(args, capsys):
    app = typer.Typer()
    app.command()(study.main)
    app(args=args, standalone_mode=False)
    return capsys.readouterr()


def test_study_json_has_every_mode_and_k(tmp_path, capsys):
    plot = tmp_path / "acc.png"
    out = run_cli(["--k", "128,1024", "--trials", "8", "--json", "--plot", str(plot)], capsys)
    result = json.loads(out.out)
    assert [row["k"] for row in result["rows"]] == [128, 1024]
    assert set(result["rows"][1]["max"]) == {"no promotion", "N_C=32", "N_C=128", "N_C=512"}
    assert "N_C=512" not in result["rows"][0]["max"]  # never triggers for K = 128
    assert result["rows"][1]["max"]["N_C=128"] < result["rows"][1]["max"]["no promotion"]
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_study_markdown_table(capsys):
    out = run_cli(["--k", "256", "--trials", "4", "--markdown"], capsys)
    assert out.out.startswith("| K |") and "| 256 |" in out.out


def test_study_rejects_bad_k(capsys):
    with pytest.raises(DSV3Error, match="--k"):
        run_cli(["--k", "12,x"], capsys)


def test_dispatcher_reports_bad_input_as_one_line(capsys):
    pytest.importorskip("dsv3.studies.logfmt_study")  # the study app imports every study module
    from dsv3.cli import main

    assert main(["study", "accumulation", "--align", "sideways"]) == 2
    assert capsys.readouterr().err.startswith("error: --align")
