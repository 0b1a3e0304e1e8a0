"""One pipeline-bubble formula (`dsv3.layout.pipeline_bubble`, the DualPipe README's) for the planner and the
bubble benchmark: its values per schedule, and both callers reading it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv3.analysis import plan as planner
from dsv3.errors import DSV3Error
from dsv3.layout import pipeline_bubble

F, B, W = 1.0, 2.0, 0.5


@pytest.mark.parametrize("schedule, pp, FB, seconds", [
    ("1f1b", 4, None, 9.0),  # (PP-1)(F+B)
    ("interleaved", 4, None, 9.0),  # the same in one rank-stage's F and B
    ("dualpipev", 4, None, 10.5),  # (8/2-1)(F&B+B-3W): 2P = 8 stages, F&B = F+B when nothing overlaps
    ("dualpipev", 4, 2.5, 9.0),  # an overlapped pair shorter than F+B
    ("dualpipe", 8, None, 10.5),  # (8/2-1)(F&B+B-3W): P = 8 stages
    ("dualpipe", 8, 2.5, 9.0),
    ("dualpipe", 2, None, 0.0),  # two ranks: the two directions fill each other's bubble
    ("1f1b", 1, None, 0.0),
])
def test_bubble_of_each_schedule(schedule, pp, FB, seconds):
    formula, value = pipeline_bubble(schedule, pp, F, B, W, FB=FB)
    assert value == seconds and formula.startswith(("(PP-1)", "(PP/2-1)"))


def test_bubble_formula_text_names_the_pair():
    assert pipeline_bubble("dualpipev", 2, F, B, W)[0] == "(PP/2-1)(F&B+B-3W), PP = 2P stages, F&B = F+B"
    assert pipeline_bubble("dualpipe", 16, F, B, W, FB=2.0)[0].endswith("F&B overlapped")


def test_bubble_is_never_negative_and_zbv_has_no_formula():
    assert pipeline_bubble("dualpipev", 4, F, B, W=3.0) == ("(PP/2-1)(F&B+B-3W), PP = 2P stages, F&B = F+B", 0.0)
    assert pipeline_bubble("zbv", 4, F, B, W) == (None, None)
    with pytest.raises(DSV3Error, match="no bubble formula for schedule 'gpipe'"):
        pipeline_bubble("gpipe", 4, F, B, W)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "1f1b"])
def test_the_planner_prices_the_bubble_with_it(schedule):
    """The planner's bubble is the formula on its chunk times: F, B, W alone and the overlapped pair."""
    arch, cluster, layout, seq, batch = planner.paper_setup()
    layout = replace(layout, schedule=schedule)
    got = planner.plan_train(arch, cluster, layout, seq, batch).breakdown["bubble"]
    a = planner.Assumptions()
    ct = planner.chunk_times(arch, planner.model_counts(arch), cluster, layout, seq, planner.Precision(), a)
    f = planner._pair_seconds(ct.f, ct.comm, a.forward_alone_overlap) + ct.p2p
    b = ct.b + ct.w + ct.comm + ct.p2p
    pair = planner._pair_seconds(ct.f + ct.b + ct.w, 2 * ct.comm + 2 * ct.p2p, a.pair_overlap)
    assert got == pipeline_bubble(schedule, 16, f, b, ct.w, FB=pair)[1] > 0


def test_the_bubble_benchmark_reports_it():
    from dsv3.parallel import pipeline_bench

    assert pipeline_bench.pipeline_bubble is pipeline_bubble
    assert not hasattr(pipeline_bench, "formula_bubble")  # one implementation
