"""Table 3's cost model: switches, switch-to-switch links (long/optical vs short/local) and endpoint cables.

The paper gives no unit prices, only "the methodology of the Slim Fly paper". Prices are therefore
parameters. The default preset ``table3`` sits in the middle of the region where all 25 cells of Table 3
(counts, cost, cost per endpoint) round to the paper's printed values; it prices Dragonfly's short
intra-group links below the long ones, as a length-aware cable model does (docs/references.md#network-cost).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv3.errors import DSV3Error
from dsv3.network.fattree import ft2_formula, ft3_formula
from dsv3.network.lowdiameter import dragonfly_formula, slimfly_formula


@dataclass(frozen=True)
class Prices:
    """Unit prices in dollars. ``switch`` includes its optics; ``local_link`` None means same as ``link``."""

    switch: float
    link: float
    local_link: float | None = None
    endpoint: float = 0.0  # NIC-to-leaf cable; Table 3 leaves it out

    def cost(self, switches: int, links: int, local_links: int = 0, endpoints: int = 0) -> float:
        local = self.link if self.local_link is None else self.local_link
        long_links = links - local_links
        return switches * self.switch + long_links * self.link + local_links * local + endpoints * self.endpoint


PRESETS: dict[str, tuple[Prices, str]] = {
    "table3": (Prices(switch=81_960, link=545, local_link=437),
               "centre of the price region that reproduces every Table 3 cell within rounding"),
    "two-price": (Prices(switch=82_428, link=526),
                  "two prices solved exactly on FT2 and FT3 (DF 1.8% high)"),
    "lsq": (Prices(switch=81_262, link=572, local_link=467),
            "relative least squares on FT2, FT3, SF, DF"),
}

# The paper's Table 3, verbatim: endpoints, switches, links, cost [M$], cost per endpoint [k$]
PAPER_TABLE3: dict[str, dict[str, float]] = {
    "FT2": {"endpoints": 2048, "switches": 96, "links": 2048, "cost_musd": 9, "cost_per_endpoint_kusd": 4.39},
    "MPFT": {"endpoints": 16384, "switches": 768, "links": 16384, "cost_musd": 72, "cost_per_endpoint_kusd": 4.39},
    "FT3": {"endpoints": 65536, "switches": 5120, "links": 131072, "cost_musd": 491,
            "cost_per_endpoint_kusd": 7.5},
    "SF": {"endpoints": 32928, "switches": 1568, "links": 32928, "cost_musd": 146, "cost_per_endpoint_kusd": 4.4},
    "DF": {"endpoints": 261632, "switches": 16352, "links": 384272, "cost_musd": 1522,
           "cost_per_endpoint_kusd": 5.8},
}
PAPER_DECIMALS = {"FT2": 2, "MPFT": 2, "FT3": 1, "SF": 1, "DF": 1}  # cost/endpoint digits the paper prints


def table3_rows(k: int = 64, planes: int = 8) -> list[dict]:
    """The five Table 3 configurations by closed form, plus the nearest buildable SF and canonical DF."""
    ft2 = ft2_formula(k, k * k // 2)
    sf28, sf27 = slimfly_formula(28), slimfly_formula(27)
    df511, df513 = dragonfly_formula(16, 32, 16, 511), dragonfly_formula(16, 32, 16, 513)
    rows = [
        ("FT2", f"two-layer fat tree, k = {k}", ft2, 0, None),
        ("MPFT", f"{planes} planes x FT2, k = {k}", {key: planes * v for key, v in ft2.items()}, 0, None),
        ("FT3", f"three-layer k-ary fat tree, k = {k}", ft3_formula(k, k**3 // 4), 0, None),
        ("SF", "Slim Fly q = 28 (delta = 0, p = 21)", sf28, 0,
         "q = 28 = 2^2 * 7 is not a prime power: no MMS graph exists; the row is the formula off its domain"),
        ("DF", "Dragonfly p = h = 16, a = 32, g = 511", df511, df511["local_links"],
         "g = 511 = a*h - 1, not the canonical a*h + 1 = 513; two spare global ports per group"),
        ("SF q=27", "nearest buildable Slim Fly (delta = -1, p = 21, radix 62)", sf27, 0, None),
        ("DF g=513", "canonical Dragonfly p = h = 16, a = 32, g = a*h + 1", df513, df513["local_links"], None),
    ]
    out = []
    for name, what, f, local, note in rows:
        if name in PAPER_TABLE3 and k != 64 and name in ("SF", "DF"):
            continue  # the SF and DF rows are the paper's fixed configurations for 64-port switches
        out.append({"row": name, "config": what, "endpoints": f["endpoints"], "switches": f["switches"],
                    "links": f["links"], "local_links": local, "note": note})
    return out


def price_table(prices: Prices, k: int = 64, planes: int = 8, endpoint_cables: bool = False) -> list[dict]:
    """Each row's cost and cost per endpoint, with the paper's values and whether they agree in rounding."""
    out = []
    for row in table3_rows(k, planes):
        cost = prices.cost(row["switches"], row["links"], row["local_links"],
                           row["endpoints"] if endpoint_cables else 0)
        row = {**row, "cost_musd": cost / 1e6, "cost_per_endpoint_kusd": cost / row["endpoints"] / 1e3}
        paper = PAPER_TABLE3.get(row["row"]) if k == 64 and planes == 8 else None
        if paper:
            digits = PAPER_DECIMALS[row["row"]]
            row["paper"] = paper
            row["matches_paper"] = {
                "counts": all(row[key] == paper[key] for key in ("endpoints", "switches", "links")),
                "cost_musd": round(row["cost_musd"]) == paper["cost_musd"],
                "cost_per_endpoint_kusd": round(row["cost_per_endpoint_kusd"], digits)
                == paper["cost_per_endpoint_kusd"],
            }
        out.append(row)
    return out


def resolve_prices(preset: str, switch: float | None = None, link: float | None = None,
                   local_link: float | None = None, endpoint: float | None = None) -> Prices:
    """A preset with any price overridden; negative prices are refused."""
    if preset not in PRESETS:
        raise DSV3Error(f"unknown price preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = asdict(PRESETS[preset][0])
    for key, value in (("switch", switch), ("link", link), ("local_link", local_link), ("endpoint", endpoint)):
        if value is not None:
            if value < 0:
                raise DSV3Error(f"--{key.replace('_', '-')}-price must be >= 0")
            base[key] = value
    return Prices(**base)
