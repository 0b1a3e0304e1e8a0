"""Table 3's cost model: the default preset reproduces every printed cell within rounding."""

import pytest

from dsv3.errors import DSV3Error
from dsv3.network.cost import PAPER_DECIMALS, PAPER_TABLE3, PRESETS, Prices, price_table, resolve_prices


def test_default_preset_reproduces_table3_within_rounding():
    rows = {r["row"]: r for r in price_table(PRESETS["table3"][0])}
    for name, paper in PAPER_TABLE3.items():
        row = rows[name]
        assert round(row["cost_musd"]) == paper["cost_musd"], name
        assert round(row["cost_per_endpoint_kusd"], PAPER_DECIMALS[name]) == paper["cost_per_endpoint_kusd"], name
        assert all(row["matches_paper"].values()), name


def test_two_price_model_misses_dragonfly_as_network_md_says():
    rows = {r["row"]: r for r in price_table(PRESETS["two-price"][0])}
    assert rows["FT2"]["cost_musd"] == pytest.approx(9.0, abs=0.05)
    assert rows["FT3"]["cost_musd"] == pytest.approx(491.0, abs=0.1)
    assert rows["DF"]["cost_musd"] == pytest.approx(1550.0, rel=2e-3)  # 1.8% above the paper's 1,522
    assert not rows["DF"]["matches_paper"]["cost_musd"]


def test_mpft_costs_the_same_per_endpoint_as_ft2_and_ft3_costs_more():
    rows = {r["row"]: r for r in price_table(Prices(switch=80_000, link=500))}
    assert rows["MPFT"]["cost_per_endpoint_kusd"] == pytest.approx(rows["FT2"]["cost_per_endpoint_kusd"])
    assert rows["FT3"]["cost_per_endpoint_kusd"] > 1.6 * rows["FT2"]["cost_per_endpoint_kusd"]


def test_cost_is_linear_in_prices():
    p = Prices(switch=1000, link=10, local_link=1, endpoint=2)
    assert p.cost(switches=3, links=5, local_links=2, endpoints=7) == 3000 + 3 * 10 + 2 * 1 + 14


def test_rows_flag_the_papers_off_domain_configurations():
    notes = {r["row"]: r["note"] for r in price_table(PRESETS["table3"][0])}
    assert "not a prime power" in notes["SF"]
    assert "511" in notes["DF"]


def test_radix_128_scales_the_fat_trees():
    rows = {r["row"]: r for r in price_table(PRESETS["table3"][0], k=128)}
    assert (rows["FT2"]["endpoints"], rows["MPFT"]["endpoints"], rows["FT3"]["switches"]) == (8192, 65536, 20480)
    assert "SF" not in rows and "paper" not in rows["FT2"]


def test_price_overrides_and_bad_presets():
    assert resolve_prices("table3", switch=1.0).switch == 1.0
    with pytest.raises(DSV3Error):
        resolve_prices("cheap")
    with pytest.raises(DSV3Error):
        resolve_prices("table3", link=-1)
