"""The engine on a CUDA device (skipped without one): inputs, masks, cache moves and merges follow the
model's device while sampling stays on the CPU, and per-request isolation holds there too."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 2, 9, 8]]


@pytest.fixture(scope="module")
def cuda_model():
    torch.backends.cuda.matmul.allow_tf32 = False
    return tiny_model().cuda()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence (no cache), on the model's device."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("speculative", [False, True])
def test_batched_and_merged_decoding_on_cuda_matches_the_reference(cuda_model, speculative):
    engine = Engine(cuda_model, speculative=speculative)
    assert engine.device.type == "cuda"
    together = engine.generate([Request(p, 10, logprobs=2) for p in PROMPTS])
    assert [r.token_ids for r in together] == [reference_greedy(cuda_model, p, 10) for p in PROMPTS]
    assert all(len(r.logprobs) == 10 and r.logprobs[0].top for r in together)
    batch = engine.start([Request(PROMPTS[0], 8)])  # continuous batching: a merge after some steps
    got = list(batch.first_events[0].token_ids)
    got += batch.step()[0].token_ids
    later = Request(PROMPTS[1], 6)
    fresh = engine.start([later])
    late = list(fresh.first_events[0].token_ids)
    batch.merge(fresh)
    while batch.rows:
        for ev in batch.step():
            (got if ev.request is not later else late).extend(ev.token_ids)
    assert got == reference_greedy(cuda_model, PROMPTS[0], 8) and late == reference_greedy(cuda_model, PROMPTS[1], 6)


def test_isolation_on_cuda(cuda_model):
    sick = copy.deepcopy(cuda_model)
    with torch.no_grad():
        sick.model.embed_tokens.weight[0] = float("nan")  # the pad token: poisons padded rows
    bad = Request([4, 0, 9], 6, SamplingParams(temperature=1.0, seed=1))
    results = Engine(sick, speculative=True).generate([Request(p, 6) for p in PROMPTS] + [bad])
    assert [r.token_ids for r in results[:3]] == [reference_greedy(cuda_model, p, 6) for p in PROMPTS]
    assert results[3].finish_reason == "error" and "non-finite" in results[3].error
