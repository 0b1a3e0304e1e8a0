"""Per-request logits processors (``Request.logits_processors``): applied to every row a request samples
from, with MTP speculation too (drafts and both verify rows), and to that request alone."""

import sys
from pathlib import Path

import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import GREEDY, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_model  # noqa: E402

HOT = SamplingParams(temperature=1.0, seed=3)


class Only:
    """Allows only ``allowed`` token ids, and records each call's ``tokens``."""

    def __init__(self, allowed: set[int], vocab: int):
        self.keep = torch.zeros(vocab, dtype=torch.bool)
        self.keep[list(allowed)] = True
        self.calls: list[list[int]] = []

    def __call__(self, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls.append(list(tokens))
        return logits.masked_fill_(~self.keep, float("-inf"))


class Script:
    """Forces a fixed sequence: at each position only the next scripted token is allowed (past its end, a
    speculative step may still ask about the position after the last token: anything goes there)."""

    def __init__(self, script: list[int]):
        self.script = script

    def __call__(self, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        assert tokens == self.script[: len(tokens)], "called with tokens the script never allowed"
        if len(tokens) == len(self.script):
            return logits
        forced = self.script[len(tokens)]
        out = torch.full_like(logits, float("-inf"))
        out[forced] = logits[forced]
        return out


def test_sampled_tokens_obey_the_processor_with_and_without_speculation():
    model = tiny_model(vocab=12, gain=3.0)
    allowed = {2, 5, 7, 11}
    for speculative in (False, True):
        for seed in range(4):
            only = Only(allowed, 12)
            params = SamplingParams(temperature=1.0, seed=seed)
            engine = Engine(model, speculative=speculative)
            out = engine.generate([Request([1, 2, 3], 30, params, logits_processors=(only,))])[0]
            assert len(out.token_ids) == 30 and set(out.token_ids) <= allowed
            assert [] in only.calls  # the prefill's first token was processed too
        if speculative:
            assert engine.last_stats.drafted > 0


def test_a_scripted_sequence_comes_out_exactly_greedy_and_sampled_with_speculation():
    model = tiny_model(vocab=12, gain=3.0)
    script = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    for params in (GREEDY, HOT):
        for speculative in (False, True):
            engine = Engine(model, speculative=speculative)
            out = engine.generate([Request([7, 7], len(script), params, logits_processors=(Script(script),))])[0]
            assert out.token_ids == script, (params, speculative)
    assert engine.last_stats.accepted > 0  # drafts drawn from the processed draft logits were accepted


def test_neighbours_are_unchanged_by_a_processed_request():
    model = tiny_model(vocab=12, gain=3.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 0]]
    for speculative in (False, True):
        solo = [Engine(model, speculative=speculative).generate([Request(p, 20)])[0].token_ids for p in prompts]
        only = Only({0, 1}, 12)
        batch = [Request(p, 20) for p in prompts] + [Request([3, 3], 20, HOT, logits_processors=(only,))]
        outs = Engine(model, speculative=speculative).generate(batch)
        assert [o.token_ids for o in outs[:3]] == solo
        assert set(outs[3].token_ids) <= {0, 1}


def test_logprobs_stay_those_of_the_raw_logits():
    model = tiny_model(vocab=12, gain=3.0)
    only = Only({4}, 12)
    out = Engine(model).generate([Request([1, 2], 3, GREEDY, logprobs=0, logits_processors=(only,))])[0]
    assert out.token_ids == [4, 4, 4]
    assert all(lp.logprob < 0 for lp in out.logprobs)  # a masked softmax would give log 1 = 0
