"""One request never harms another inside the engine and the scheduler: a request that cannot start, a
row whose logits turn non-finite, padding poisoned by a broken token, a prefill that raises."""

import asyncio
import copy

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import GREEDY, SamplingParams
from dsv3.infer.scheduler import Scheduler

PROMPTS = [[5, 17, 42, 99, 7], [11, 12], [200, 100, 50, 25, 12, 6, 3]]


def alone(model, prompt, n=8, params=GREEDY, speculative=False):
    return Engine(model, speculative=speculative).generate([Request(prompt, n, params)])[0]


def broken_params(seed: int) -> SamplingParams:
    """Sampling parameters that skipped validation (as a caller building them by hand might)."""
    params = SamplingParams(temperature=0.0)
    object.__setattr__(params, "seed", seed)
    return params


def sick_copy(model, **edits):
    """A copy of ``model`` with NaN written into it in memory (load-time validation never sees it)."""
    sick = copy.deepcopy(model)
    with torch.no_grad():
        for name, index in edits.items():
            dict(sick.named_parameters())[name][index] = float("nan")
    return sick


def test_seed_out_of_range_is_refused_up_front():
    with pytest.raises(DSV3Error, match="seed"):
        SamplingParams(seed=2**70)
    with pytest.raises(DSV3Error, match="seed"):
        SamplingParams(seed=-1)
    with pytest.raises(DSV3Error, match="temperature"):
        SamplingParams(temperature=float("nan"))
    assert SamplingParams(seed=2**64 - 1).generator().initial_seed() == 2**64 - 1


def test_a_request_that_cannot_start_fails_alone(model):
    """The seed that overflowed torch's generator when the batch started failed every row with it."""
    bad = Request([1, 2, 3], 8, broken_params(2**70))
    requests = [Request(PROMPTS[0], 8), bad, Request(PROMPTS[1], 8)]
    results = Engine(model).generate(requests)
    assert results[1].finish_reason == "error" and "Overflow" in results[1].error and not results[1].token_ids
    assert [r.token_ids for r in (results[0], results[2])] == [alone(model, p).token_ids for p in PROMPTS[:2]]


def per_row_checks(monkeypatch) -> None:
    """The engine checks and picks each row by itself (sampling.all_finite, greedy_tokens) instead of its one
    C scan of a step's logits (FastDecode.scan_logits), as without the kernels."""
    from dsv3.kernels.decode import FastDecode

    monkeypatch.setattr(FastDecode, "scan_logits", lambda self, logits: None)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("scan", [True, False])
def test_a_nan_expert_ends_the_request_with_a_clear_error(model, speculative, temperature, scan, monkeypatch):
    """Greedy used to emit token 0 (the argmax of NaN logits) silently; sampling raised in multinomial
    and failed the whole batch."""
    if not scan:
        per_row_checks(monkeypatch)
    sick = sick_copy(model, **{"model.layers.1.mlp.experts.down_proj": 0})
    sick.model.layers[1].mlp.gate.e_score_correction_bias[0] = 100.0  # every token is routed to expert 0
    result = Engine(sick, speculative=speculative).generate(
        [Request(PROMPTS[0], 8, SamplingParams(temperature=temperature, seed=1))])[0]
    assert result.finish_reason == "error" and result.token_ids == []
    assert "non-finite" in result.error and "position 5" in result.error


@pytest.mark.parametrize("speculative", [False, True])
def test_poisoned_padding_does_not_spread_to_other_rows(model, speculative):
    """Token 0 pads the shorter prompts of a batch; with its embedding NaN, the masked pad slots held NaN
    and attention's 0 * NaN poisoned the padded rows. Such a batch is prefilled one request at a time,
    and only the request that really contains the broken token fails."""
    sick = sick_copy(model, **{"model.embed_tokens.weight": 0})
    bad = Request([4, 0, 9], 6)
    results = Engine(sick, speculative=speculative).generate([Request(p, 6) for p in PROMPTS] + [bad])
    assert [r.token_ids for r in results[:3]] == [alone(model, p, 6).token_ids for p in PROMPTS]
    assert results[3].finish_reason == "error"


@pytest.mark.parametrize("scan", [True, False])
def test_a_row_that_turns_non_finite_mid_decode_leaves_the_others(model, scan, monkeypatch):
    if not scan:
        per_row_checks(monkeypatch)
    first = alone(model, PROMPTS[0], 8).token_ids
    sick = sick_copy(model, **{"model.embed_tokens.weight": first[2]})  # its third token breaks it
    others = [p for p in PROMPTS[1:] if first[2] not in alone(model, p, 8).token_ids + p]
    assert others
    results = Engine(sick).generate([Request(PROMPTS[0], 8)] + [Request(p, 8) for p in others])
    assert results[0].finish_reason == "error" and results[0].token_ids == first[:3]
    assert [r.token_ids for r in results[1:]] == [alone(model, p).token_ids for p in others]


def test_the_scheduler_retries_a_failing_prefill_one_request_at_a_time(model, monkeypatch):
    engine = Engine(model)
    cursed = Request([9, 9, 9], 4)
    real_start = engine.start

    def start(requests):
        if cursed in requests:
            raise RuntimeError("this request breaks the prefill")
        return real_start(requests)

    monkeypatch.setattr(engine, "start", start)
    requests = [Request(PROMPTS[0], 6), cursed, Request(PROMPTS[1], 6)]

    async def run():
        scheduler = Scheduler(engine, max_batch=8)
        queues = [scheduler.submit(r) for r in requests]  # all pending before the worker starts: one group
        scheduler.start()
        try:
            out = []
            for q in queues:
                items = []
                while not items or not (isinstance(items[-1], BaseException) or items[-1].finish_reason):
                    items.append(await asyncio.wait_for(q.get(), timeout=20))
                out.append(items)
            return out
        finally:
            scheduler.stop()

    good0, failed, good1 = asyncio.run(run())
    assert isinstance(failed[-1], RuntimeError)
    assert [sum((e.token_ids for e in g), []) for g in (good0, good1)] == \
        [alone(model, p, 6).token_ids for p in PROMPTS[:2]]


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_are_the_log_softmax_of_the_raw_logits(model, speculative):
    prompt, n = PROMPTS[2], 6
    params = SamplingParams(temperature=0.7, top_k=5, seed=3)  # sampling settings do not change logprobs
    result = Engine(model, speculative=speculative).generate([Request(prompt, n, params, logprobs=3)])[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids]))[0, len(prompt) - 1 : -1]
    ref = logits.log_softmax(-1)
    assert len(result.logprobs) == n
    for j, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[j]
        assert entry.logprob == pytest.approx(float(ref[j, entry.token_id]), abs=1e-4)
        best = ref[j].topk(3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_requests_without_logprobs_carry_none(model):
    assert Engine(model).generate([Request(PROMPTS[1], 3)])[0].logprobs is None
