"""The engine: absorbed decode over the latent cache against the expanded path, batching of prompts of
different lengths, continuous batching (merge), stops, streaming text, and the cache's size."""

import pytest
import torch

from dsv3.infer.engine import Engine, Request
from dsv3.kernels import decode_kernels as dk
from dsv3.kernels.decode import AttentionPlan
from dsv3.model.mla import MLA


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding by re-running the whole sequence through the expanded path (no cache)."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids]))[0, -1]
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt):], logits


def collect(engine, requests):
    got = {id(r): [] for r in requests}
    for ev in engine.stream(requests):
        got[id(ev.request)] += ev.token_ids
    return [got[id(r)] for r in requests]


PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 2, 9, 8]]


@pytest.mark.parametrize("fast", [False, True])
def test_absorbed_decode_equals_expanded_path_token_for_token(model, monkeypatch, fast):
    """Both decode paths: the modules' (MLA._absorbed) and FastDecode's (its step kernel, which runs every
    block kernel, or AttentionPlan)."""
    calls = {"absorbed": 0}
    cls = AttentionPlan if fast else MLA
    original = cls.__call__ if fast else MLA._absorbed

    def counting(self, *args):
        calls["absorbed"] += 1
        return original(self, *args)

    monkeypatch.setattr(cls, "__call__" if fast else "_absorbed", counting)
    if fast:  # with the C kernels a whole step is one call, every block's attention in it
        step = dk.decode_step

        def counting_step(*args):
            calls["absorbed"] += model.config.num_hidden_layers
            return step(*args)

        monkeypatch.setattr(dk, "decode_step", counting_step)
    engine = Engine(model, fast=fast)
    batch = engine.start([Request(PROMPTS[0], 24)])
    tokens = list(batch.first_events[0].token_ids)
    with torch.no_grad():
        while batch.rows:
            tokens += batch.step()[0].token_ids
    expected, _ = reference_greedy(model, PROMPTS[0], 24)
    assert tokens == expected
    assert calls["absorbed"] == 23 * model.config.num_hidden_layers  # every decode step, every layer


def test_absorbed_logits_match_expanded_logits(model):
    prompt = PROMPTS[2]
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(torch.tensor([prompt[:-1]]), cache=cache)
        absorbed = model(torch.tensor([prompt[-1:]]), cache=cache, start_pos=len(prompt) - 1)[0, -1]
        expanded = model(torch.tensor([prompt]))[0, -1]
    assert torch.allclose(absorbed, expanded, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("speculative", [False, True])
def test_batch_of_different_lengths_equals_each_alone(model, speculative):
    engine = Engine(model, speculative=speculative)
    alone = [collect(engine, [Request(p, 12)])[0] for p in PROMPTS]
    together = collect(engine, [Request(p, 12) for p in PROMPTS])
    assert together == alone
    assert all(len(t) == 12 for t in together)


@pytest.mark.parametrize("speculative", [False, True])
def test_merged_batches_equal_each_alone(model, speculative):
    """Continuous batching: requests that join a running batch decode exactly as they would alone."""
    engine = Engine(model, speculative=speculative)
    alone = [collect(engine, [Request(p, n)])[0] for p, n in zip(PROMPTS, (14, 10, 6), strict=True)]
    first = [Request(PROMPTS[0], 14)]
    got = {id(first[0]): []}
    batch = engine.start(first)
    events = list(batch.first_events)
    for _ in range(4):
        events += batch.step()
    later = [Request(PROMPTS[1], 10), Request(PROMPTS[2], 6)]
    got.update({id(r): [] for r in later})
    fresh = engine.start(later)
    events += fresh.first_events
    batch.merge(fresh)
    while batch.rows:
        events += batch.step()
    for ev in events:
        got[id(ev.request)] += ev.token_ids
    assert [got[id(r)] for r in first + later] == alone


@pytest.mark.parametrize("speculative", [False, True])
def test_a_batch_that_never_empties_keeps_its_slots_bounded(model, speculative):
    """A steady stream: a request joins every 3 steps and each decodes 6 tokens, so the batch never empties
    in 36 steps. The slots no remaining row holds are dropped as rows leave and join, so the slot counter
    stays within the longest live history (prompt, 6 tokens, and with MTP a hole per step at most), not one
    or two slots a step since the start; every request's tokens equal its tokens alone."""
    engine = Engine(model, speculative=speculative)
    prompts = [PROMPTS[i % 3][: 2 + i % 9] for i in range(12)]
    alone = [collect(engine, [Request(p, 6)])[0] for p in prompts]
    requests = [Request(p, 6) for p in prompts]
    got = {id(r): [] for r in requests}
    batch, most = None, 0
    for step in range(36):
        if step % 3 == 0:
            fresh = engine.start([requests[step // 3]])
            for ev in fresh.first_events:
                got[id(ev.request)] += ev.token_ids
            batch = fresh if batch is None else (batch.merge(fresh) or batch)
        for ev in batch.step():
            got[id(ev.request)] += ev.token_ids
        assert batch.rows  # never empty before the last request joined
        most = max(most, batch.cur)
    while batch.rows:
        for ev in batch.step():
            got[id(ev.request)] += ev.token_ids
    assert [got[id(r)] for r in requests] == alone
    longest = max(map(len, prompts)) + 6 + (6 if speculative else 0) + 2
    assert most <= longest < 36


def test_cancelled_request_leaves_the_batch(model):
    engine = Engine(model)
    keep, leave = Request(PROMPTS[0], 10), Request(PROMPTS[1], 10)
    batch = engine.start([keep, leave])
    batch.step()
    free, held = engine.pool.free, len(batch.pages[1])
    leave.cancelled = True
    events = batch.step()
    assert [e.finish_reason for e in events if e.request is leave] == ["cancelled"]
    assert [r.request for r in batch.rows] == [keep]
    assert batch.cache.rows == 1 and engine.pool.free == free + held  # its pages are given back too


def test_stops_at_eos_and_max_tokens(model):
    free = collect(Engine(model), [Request(PROMPTS[0], 10)])[0]
    eos = free[4]
    engine = Engine(model, eos_token_ids=frozenset([eos]))
    result = engine.generate([Request(PROMPTS[0], 10)])[0]
    assert result.token_ids == free[: free.index(eos) + 1] and result.finish_reason == "stop"
    assert Engine(model).generate([Request(PROMPTS[0], 3)])[0].finish_reason == "length"


def test_stop_strings_and_streamed_text(model, tokenizer):
    engine = Engine(model, tokenizer)
    prompt = tokenizer.encode("the cat").ids
    full = engine.generate([Request(prompt, 30)])[0]
    assert full.text == tokenizer.decode(full.token_ids)
    pieces = [ev.text for ev in engine.stream([Request(prompt, 30)])]
    assert "".join(pieces) == full.text and len([p for p in pieces if p]) > 1
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    stopped = engine.generate([Request(prompt, 30, stop_strings=(stop,))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_cache_bytes_per_token_per_layer_from_the_allocation(model):
    cfg = model.config
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float8_e4m3fn, 1)):
        cache = model.new_cache(1, 100, dtype=dtype)
        layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        assert cache.nbytes == 100 * layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
        assert cache.bytes_per_token_per_layer() == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size


def test_fp8_and_bf16_caches_stay_close(model):
    """Lower-precision caches perturb the logits only slightly; FP8 (e4m3, no scale) is the lossier."""
    prompt = PROMPTS[2]
    errors = {}
    with torch.no_grad():
        ref = None
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            cache = model.new_cache(1, 32, dtype=dtype)
            model(torch.tensor([prompt[:-1]]), cache=cache)
            out = model(torch.tensor([prompt[-1:]]), cache=cache, start_pos=len(prompt) - 1)[0, -1]
            ref = out if ref is None else ref
            errors[dtype] = float((out - ref).norm() / ref.norm())
    assert errors[torch.bfloat16] < 0.02
    assert errors[torch.bfloat16] < errors[torch.float8_e4m3fn] < 0.15


def test_a_list_of_eos_ids_in_the_config_stops_on_any_of_them(model):
    """HF configs may give eos_token_id as a list; the engine stops at whichever comes first."""
    import copy
    import dataclasses

    from dsv3.infer.loading import eos_ids

    free = collect(Engine(model), [Request(PROMPTS[0], 10)])[0]
    listed = copy.copy(model)
    listed.config = dataclasses.replace(model.config, eos_token_id=[free[6], free[3]])
    result = Engine(listed).generate([Request(PROMPTS[0], 10)])[0]
    first = min(free.index(free[6]), free.index(free[3]))
    assert result.token_ids == free[: first + 1] and result.finish_reason == "stop"
    assert eos_ids(listed, None) == {free[6], free[3]}


def test_greedy_rows_take_the_argmax_without_a_random_draw(model, monkeypatch):
    """A multinomial over the whole vocabulary cost about 1 ms per row and step; plain greedy decoding
    needs none (speculative verification still draws, see speculative.verify)."""
    expected = reference_greedy(model, PROMPTS[0], 8)[0]

    def refuse(*args, **kwargs):
        raise AssertionError("greedy decoding drew from a multinomial")

    monkeypatch.setattr(torch, "multinomial", refuse)
    assert collect(Engine(model), [Request(PROMPTS[0], 8)])[0] == expected


@pytest.mark.parametrize("speculative", [False, True])
def test_short_prompts_arriving_together_prefill_on_the_kernels_in_groups(model, speculative, monkeypatch):
    """Five prompts (up to 20 tokens, 86 in all: more than one kernel call holds) are prefilled on the decode
    step's kernels three rows a call, and decode as they do when the model's modules prefill them."""
    prompts = [[(7 * i + j) % 50 + 1 for j in range(n)] for i, n in enumerate((20, 17, 12, 20, 17))]
    engine = Engine(model, speculative=speculative)
    engine.kernel_prefill_tokens = 0
    modules = collect(engine, [Request(p, 8) for p in prompts])
    engine.kernel_prefill_tokens = 128
    calls = []
    original = engine.decoder.hidden_states
    monkeypatch.setattr(engine.decoder, "hidden_states",
                        lambda ids, **k: calls.append((tuple(ids.shape), k["start_pos"])) or original(ids, **k))
    monkeypatch.setattr(model, "hidden_states", lambda *a, **k: pytest.fail("the prompts ran through the modules"))
    batch = engine.start([Request(p, 8) for p in prompts])
    assert calls == [((3, 20), 0), ((2, 20), 0)]
    monkeypatch.undo()
    batch.release()
    assert collect(engine, [Request(p, 8) for p in prompts]) == modules
