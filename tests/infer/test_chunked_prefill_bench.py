"""benchmarks/chunked_prefill.py's summary of one run, on gaps made up here: the windows it reads (before the long
prompt, and the gaps that overlap its prefill) and the goal's ratio as the product of the streams' held pace and
their spread while the prompt is prefilled."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import chunked_prefill  # noqa: E402


def test_the_goal_ratio_is_the_held_pace_times_the_spread_while_prefilled():
    before = [(-1.0 + i / 100, ms) for i, ms in enumerate([4.0] * 99 + [9.0])]  # ends before the arrival
    during = [(0.01 * (i + 1), ms) for i, ms in enumerate([10.0] * 90 + [13.0] * 10)]  # ends within the TTFT
    late = [(2.0, 100.0)]  # starts after the first token: not in either window
    spanning = [(1.005, 12.0)]  # starts before the first token, ends after it: overlaps the prefill
    s = chunked_prefill.summary({"ttft_ms": 1000.0, "gaps": before + during + spanning + late})
    assert s["tpot_ms_median_before"] == 4.0 and s["tpot_ms_median_during"] == 10.0
    assert s["tokens_during"] == 101 and s["tpot_ms_max_during"] == 13.0
    assert s["median_during_over_median_before"] == 2.5
    assert s["p99_during_over_median"] == pytest.approx(s["median_during_over_median_before"]
                                                        * s["p99_during_over_median_during"])
    assert s["p99_during_over_median_during"] == pytest.approx(1.3)
