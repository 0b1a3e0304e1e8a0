"""Pieces of multi-process serving that need no processes: the front end's assignment of requests and of
latent-cache moves, the hand-over of a prefilled row (its state and its cache slots) into a decode batch,
and the serve flags' errors."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_model  # noqa: E402
from dsv3.cli import main  # noqa: E402
from dsv3.infer.cluster.disagg import (  # noqa: E402
    RowState,
    batch_from_cache,
    cache_bytes_per_token,
    pack_row,
    unpack_state,
)
from dsv3.infer.cluster.frontend import ClusterScheduler  # noqa: E402
from dsv3.infer.cluster.rank import Ready, WireRequest  # noqa: E402
from dsv3.infer.engine import Engine, Request  # noqa: E402
from dsv3.infer.sampling import GREEDY, SamplingParams  # noqa: E402


class _Worker:
    rank = 0


def _scheduler(world: int, max_batch: int, **sides) -> ClusterScheduler:
    engine = SimpleNamespace(prefix_cache=None)  # the front end's assignment logic never runs the engine
    return ClusterScheduler(engine, _Worker(), world, max_batch, **sides)


def _queue(s: ClusterScheduler, n: int) -> list[Request]:
    requests = [Request([1, 2, 3], 4) for _ in range(n)]
    for r in requests:
        s.pending.put((r, lambda item: None))
    return requests


def test_requests_go_to_the_least_loaded_rank_and_wait_when_every_rank_is_full():
    s = _scheduler(3, 2)
    s.load = [1, 0, 2]
    _queue(s, 4)
    new = s._assign()
    assert {r: len(v) for r, v in new.items()} == {1: 2, 0: 1}  # rank 1; then 0 and 1 tie (lower first); 1
    assert s.load == [2, 2, 2] and len(s.waiting) == 1
    s.load = [2, 1, 2]
    assert list(s._assign()) == [1] and not s.waiting


def test_requests_waiting_for_a_rank_with_room_count_as_waiting_in_metrics():
    s = _scheduler(2, 1)
    s.load = [1, 1]  # every rank full: the front end takes the requests in, and they wait
    _queue(s, 3)
    assert not s._assign() and len(s.waiting) == 3
    assert s.metrics.waiting() == 3
    s.load = [0, 1]
    s._assign()
    assert s.metrics.waiting() == 2


def test_prefilled_requests_move_to_the_least_loaded_decode_rank_with_room():
    s = _scheduler(4, 2, prefill=[0, 1], decode=[2, 3])
    _queue(s, 3)
    new = s._assign()
    assert sorted(new) == [0, 1] and s.load == [2, 1, 0, 0]
    rids = [w.rid for ws in new.values() for w in ws]
    s.ready = [Ready(rid, s.inflight[rid][1], 5, 100) for rid in rids]  # rids 0 and 2 on rank 0, 1 on rank 1
    s.load[2:] = [1, 2]  # decode rank 3 is full, rank 2 has room for one
    moves = s._transfers(cancelled={1})  # rid 1's client went away: it is not moved (its prefill rank drops it)
    assert [(m.rid, m.src, m.dst, m.slots, m.state_bytes) for m in moves] == [(0, 0, 2, 5, 100)]
    assert s.inflight[0][1] == 2 and s.load == [1, 1, 2, 2]
    assert [r.rid for r in s.ready] == [2]  # waits on its prefill rank for room
    s.load[3] = 1
    assert [(m.rid, m.dst) for m in s._transfers(set())] == [(2, 3)] and not s.ready


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prefilled_row_handed_over_decodes_exactly_as_in_one_process(speculative):
    """The row of a padded two-row prefill, packed (its own slots only), unpickled and rebuilt over a
    one-row batch, continues with the tokens one process gives; the cache moved is its bytes per token."""
    engine = Engine(tiny_model(layers=2), speculative=speculative)
    short, long = Request([5, 6, 7], 12), Request([9, 8, 7, 6, 5, 4, 3], 12)
    want = engine.generate([Request(short.prompt_ids, 12)])[0].token_ids
    batch = engine.start([long, short])  # the short row is left-padded: 4 slots are not its own
    wire = WireRequest(7, short.prompt_ids, 12, GREEDY, frozenset(), (), None)
    parcel = pack_row(engine, batch, 1, RowState.of(wire, batch.rows[1]))
    assert parcel.kv.shape[1] == 3
    assert (parcel.kv.nbytes + parcel.pe.nbytes) / 3 == cache_bytes_per_token(engine)
    state = unpack_state(parcel)
    moved = batch_from_cache(engine, state.row(engine, state.request.request()), parcel.kv, parcel.pe)
    got = list(state.generated)
    while moved.rows:
        got += [t for ev in moved.step() for t in ev.token_ids]
    assert got == want


def test_a_seeded_sampled_row_keeps_its_random_stream_across_the_move():
    engine = Engine(tiny_model(layers=2))
    params = SamplingParams(temperature=1.0, seed=11)
    want = engine.generate([Request([5, 6, 7], 10, params)])[0].token_ids
    batch = engine.start([Request([5, 6, 7], 10, params)])
    wire = WireRequest(1, [5, 6, 7], 10, params, frozenset(), (), None)
    parcel = pack_row(engine, batch, 0, RowState.of(wire, batch.rows[0]))
    state = unpack_state(parcel)
    moved = batch_from_cache(engine, state.row(engine, state.request.request()), parcel.kv, parcel.pe)
    got = list(state.generated)
    while moved.rows:
        got += [t for ev in moved.step() for t in ev.token_ids]
    assert got == want


def test_a_row_with_penalties_keeps_their_counts_and_ignore_eos_across_the_move():
    """The penalties count the tokens generated before the move (its first token, from the prefill rank), and
    ``ignore_eos`` travels with the request: the moved row decodes as one process does."""
    engine = Engine(tiny_model(layers=2), eos_token_ids=frozenset({209}))  # its second token here
    params = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5)
    request = Request([1, 2, 3], 16, params, ignore_eos=True)  # without the penalty, its first token comes twice
    want = engine.generate([Request([1, 2, 3], 16, params, ignore_eos=True)])[0].token_ids
    assert 209 in want
    batch = engine.start([request])
    wire = WireRequest.of(3, request)
    parcel = pack_row(engine, batch, 0, RowState.of(wire, batch.rows[0]))
    state = unpack_state(parcel)
    assert state.request.request().ignore_eos
    moved = batch_from_cache(engine, state.row(engine, state.request.request()), parcel.kv, parcel.pe)
    got = list(state.generated)
    while moved.rows:
        got += [t for ev in moved.step() for t in ev.token_ids]
    assert got == want and len(got) == 16


def test_a_constrained_row_moved_mid_generation_rebuilds_its_matcher_from_the_tokens_generated():
    """A json_schema request (sampled, seeded, MTP drafts masked too) moved to another rank after 3 decode
    steps: the WireRequest carries the grammar's text, the new rank compiles its own matcher, which follows the
    tokens generated so far; the row finishes with the tokens one process gives, and they parse."""
    import json

    import jsonschema
    from deepseek_tokens import deepseek_tokenizer

    from dsv3.infer.grammar import Grammars
    from dsv3.infer.loading import eos_ids

    tok, model = deepseek_tokenizer(), tiny_model(300)
    eos = eos_ids(model, tok)
    schema = {"type": "object", "additionalProperties": False, "required": ["x", "tag"],
              "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}}}
    grammar = Grammars(tok, 300, eos)
    engine = Engine(model, tok, speculative=True, eos_token_ids=eos)
    params, prompt = SamplingParams(temperature=1.0, seed=5), tok.encode("hello").ids

    def request() -> Request:
        return Request(prompt, 60, params, logits_processors=(grammar.json_schema(schema, "response_format"),))

    want = engine.generate([request()])[0].token_ids
    batch, sent = engine.start([request()]), request()
    for _ in range(3):
        batch.step()
    wire = WireRequest.of(4, sent)
    assert wire.grammars and isinstance(wire.grammars[0], str)  # plain text: it pickles
    other_rank = Grammars(tok, 300, eos)
    parcel = pack_row(engine, batch, 0, RowState.of(wire, batch.rows[0]))
    state = unpack_state(parcel)
    assert len(state.generated) > 3
    moved = batch_from_cache(engine, state.row(engine, state.request.request(other_rank)), parcel.kv, parcel.pe)
    got = list(state.generated)
    while moved.rows:
        got += [t for ev in moved.step() for t in ev.token_ids]
    assert got == want
    jsonschema.validate(json.loads(tok.decode([t for t in got if t not in eos])), schema)


def test_a_grammar_a_rank_cannot_compile_fails_its_request_alone():
    """A grammar text the rank's compiler refuses ends its request with an error event at admission; the
    request admitted beside it prefills and decodes, and the rank's step does not raise (which would take
    the whole group down)."""
    from deepseek_tokens import deepseek_tokenizer

    from dsv3.infer.cluster.rank import RankWorker
    from dsv3.infer.loading import eos_ids

    tok, model = deepseek_tokenizer(), tiny_model(300)
    engine = Engine(model, tok, eos_token_ids=eos_ids(model, tok))
    worker = RankWorker(engine, lockstep=None, rank=1)  # admission runs no expert exchange here
    bad = WireRequest(1, [5, 6, 7], 4, GREEDY, frozenset(), (), None, grammars=("start: %%% not a grammar",))
    good = WireRequest(2, [5, 6, 7], 4, GREEDY, frozenset(), (), None)
    events = worker._wire(worker._admit([worker._register(bad), worker._register(good)]))
    (failed,) = [e for e in events if e.rid == 1]
    assert failed.finish_reason == "error" and failed.error.startswith("generation failed on rank 1: grammar:")
    assert [e.rid for e in events if e.rid == 2 and e.token_ids] == [2] and worker.active == 1
    assert not worker.unusable


@pytest.mark.parametrize("flags, message", [
    (["--ep", "4"], "start it with dsv3 launch --nproc 4 serve"),
    (["--ep", "0"], "--ep must be >= 1"),
    (["--ep", "4", "--prefill-ranks", "4"], "--prefill-ranks must be between 1 and --ep - 1 (3)"),
    (["--ep", "4", "--dispatch", "fp4"], "--dispatch must be one of native, bf16, fp8, fp32"),
    (["--ep", "4", "--combine", "fp8"], "--combine must be one of native, bf16, logfmt8, logfmt10, fp32"),
    (["--prefill-ranks", "2"], "need --ep N"),
    (["--micro-batches", "2"], "need --ep N"),
    (["--ep", "4", "--micro-batches", "3"], "--micro-batches must be 1 or 2, got 3"),
    (["--ep", "4", "--redundant-experts", "2", "--eplb-every", "2", "--weights", "fp8"],
     "cannot rebalance resident FP8 experts"),
    (["--ep", "4", "--weights", "int4"], "--weights int4 runs in one process; --ep N takes --weights native or fp8"),
])
def test_serve_group_flags_end_with_one_error_line(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    tiny_model(layers=1).save_pretrained(tmp_path)
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_lossless_wire_format_is_the_compute_dtype():
    from dsv3.infer.cluster.lockstep import native_format

    model = tiny_model(layers=1)
    assert native_format(model) == "fp32"
    assert native_format(model.to(torch.bfloat16)) == "bf16"


def test_each_rank_knows_its_experts_before_loading():
    """`rank_experts`: the experts a rank reads from the checkpoint are the slots its EP group's placement
    gives it (contiguous, per group under --prefill-ranks, with EPLB's replicas under --redundant-experts)."""
    from dsv3.config import preset
    from dsv3.infer.cluster.lockstep import group_placement
    from dsv3.infer.cluster.serve import GroupOptions, rank_experts

    cfg = preset("nano").replace(n_routed_experts=8)
    assert [rank_experts(GroupOptions(ep=4), 4, r, cfg) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    split = GroupOptions(ep=4, prefill_ranks=2)  # two groups of two: each holds every expert
    assert [rank_experts(split, 4, r, cfg) for r in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    spare = GroupOptions(ep=4, redundant_experts=4)
    placement = group_placement(8, 4, 4)
    assert [rank_experts(spare, 4, r, cfg) for r in range(4)] == [placement.rank_experts(r).tolist() for r in range(4)]
    slots = [e for r in range(4) for e in rank_experts(spare, 4, r, cfg)]
    assert len(slots) == 12 and set(slots) == set(range(8))  # every expert once, 4 of them twice
    assert rank_experts(GroupOptions(ep=2), 2, 0, cfg.replace(n_routed_experts=None)) is None
