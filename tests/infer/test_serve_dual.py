"""Dual micro-batch decode (`serve --ep 4 --micro-batches 2`) on four gloo processes: each decode step of a
rank with two rows or more runs as two halves whose expert exchanges are paired in the group's lockstep
rounds. Greedy completions must equal one process's whatever each rank holds: odd and even numbers of
rows, a single row (paired with an empty half), an idle rank, rows joining mid-decode; and with prefill
and decode on separate ranks (MTP speculation on, the verify step split too)."""

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_serve_ep import ask_all, checkpoint, reference_mtp, serve_group  # noqa: E402, F401 (fixtures)

pytest.importorskip("openai")

PROMPTS = [[5, 17, 33, 2, 90], [120, 7, 7, 64], [250, 1, 3, 9, 27, 81, 243], [42, 42], [8, 9, 10], [77, 1, 200],
           [31, 41, 59, 26, 53], [2, 7, 18, 28]]
MAX_TOKENS = [9, 6, 11, 7, 8, 10, 6, 9]
# (step, rank, prompt): rank 0 holds 3 rows, rank 1 two then three (prompt 7 joins at step 2), rank 2 one
# row, rank 3 nothing until prompt 6 joins at step 3; rows leave at different steps
SCHEDULE = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 3), (0, 1, 4), (0, 2, 5), (2, 1, 7), (3, 3, 6)]


def test_dual_micro_batch_decode_on_4_ranks_equals_one_process(checkpoint):  # noqa: F811 (a fixture)
    from dsv3.testing.launch import launch
    from dsv3.testing.serve_dual_scenarios import dual_generation, reference_tokens

    want = reference_tokens(str(checkpoint), PROMPTS, MAX_TOKENS)
    ranks = launch(dual_generation, 4, (str(checkpoint), PROMPTS, MAX_TOKENS, SCHEDULE), timeout_s=240)
    got = {i: ids for r in ranks for i, ids in r["tokens"].items()}
    assert [got[i] for i in range(len(PROMPTS))] == want
    split = [r["split_steps"] for r in ranks]
    assert split[0] >= 4 and split[1] >= 4  # ranks with two rows or more decoded in two halves ...
    assert split[2] == split[3] == 0  # ... a rank with one row (or none) did not
    assert len({r["rounds"] for r in ranks}) == 1


def test_dual_micro_batch_decode_group_with_prefill_ranks_equals_one_process(checkpoint, reference_mtp):  # noqa: F811
    """`serve --ep 4 --prefill-ranks 2 --micro-batches 2 --speculative mtp`: the decode group (ranks 2-3)
    splits its steps, the verify forward included (MTP drafts stay one micro-batch beside an empty half)."""
    flags = ("--prefill-ranks", "2", "--micro-batches", "2", "--speculative", "mtp")
    with serve_group(checkpoint, 4, *flags) as group:
        assert ask_all(group.url) == reference_mtp
        state = httpx.get(group.url + "/cluster").json()
    assert sum(state["assigned"][2:]) == 8 and min(state["assigned"][2:]) >= 1
    assert "dual micro-batch decode" in "\n".join(group.lines)
