"""A strict reader of the Prometheus text format (0.0.4) for tests, cross-checked with prometheus_client's
own parser when it is installed."""

from __future__ import annotations

import math
import re

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
HELP = re.compile(rf"^# HELP ({NAME}) (.+)$")
TYPE = re.compile(rf"^# TYPE ({NAME}) (counter|gauge|histogram)$")
SAMPLE = re.compile(rf'^({NAME})(\{{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"(?:,|(?=\}})))*\}})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _value(text: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(text) or float(text)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value}; AssertionError on anything out of format: a sample outside
    its family, a counter not ending in _total, a histogram without +Inf, non-cumulative buckets, a
    _count that disagrees with the +Inf bucket, a family declared twice."""
    assert text.endswith("\n")
    samples: dict = {}
    families: dict[str, str] = {}
    helped: set[str] = set()
    family = kind = None
    for line in text.splitlines():
        if line.startswith("# HELP"):
            m = HELP.match(line)
            assert m, line
            assert m.group(1) not in helped, f"HELP twice: {line}"
            helped.add(m.group(1))
            continue
        if line.startswith("# TYPE"):
            m = TYPE.match(line)
            assert m and m.group(1) in helped and m.group(1) not in families, line
            family, kind = m.groups()
            families[family] = kind
            if kind == "counter":
                assert family.endswith("_total"), line
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), dict(LABEL.findall(m.group(2) or "")), _value(m.group(3))
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        assert any(name == f"{family}{s}" for s in suffixes), f"{name} outside family {family}"
        key = (name, tuple(sorted(labels.items())))
        assert key not in samples, f"duplicate sample {line}"
        samples[key] = value
    for name, kind in families.items():
        if kind == "histogram":
            buckets = [(float(dict(k[1])["le"].replace("+Inf", "inf")), v) for k, v in samples.items()
                       if k[0] == f"{name}_bucket"]
            assert buckets and buckets[-1][0] == math.inf, name
            assert [b for b, _ in buckets] == sorted(b for b, _ in buckets), name
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False)), f"{name} not cumulative"
            assert samples[(f"{name}_count", ())] == buckets[-1][1], name
    _cross_check(text, samples)
    return samples


def _cross_check(text: str, samples: dict) -> None:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    theirs = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            theirs[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert set(theirs) == set(samples)
    for key, value in samples.items():
        assert theirs[key] == value or (math.isnan(value) and math.isnan(theirs[key])), key


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def total(samples: dict, name: str, **labels) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items())
