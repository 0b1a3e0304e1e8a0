"""MTP speculative decoding: greedy output identical to plain greedy, and sampled output distributed
exactly as plain sampling (rejection sampling), checked by chi-square tests on a tiny vocabulary."""

import sys
from pathlib import Path

import torch

from dsv3.infer.engine import Engine, Request
from dsv3.infer.sampling import SamplingParams, probabilities
from dsv3.infer.speculative import verify

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_model  # noqa: E402


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test; cells expected below ``min_expected`` are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def test_greedy_speculative_equals_plain_greedy_with_accepts_and_rejects():
    model = tiny_model(vocab=12, gain=3.0)  # a small vocabulary: the random MTP draft is right sometimes
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 0], [3, 3, 3, 3]]
    for prompt in prompts:
        plain = Engine(model).generate([Request(prompt, 40)])[0].token_ids
        spec_engine = Engine(model, speculative=True)
        spec = spec_engine.generate([Request(prompt, 40)])[0].token_ids
        assert spec == plain
    stats = spec_engine.last_stats
    batch = Engine(model, speculative=True)
    assert [r.token_ids for r in batch.generate([Request(p, 40) for p in prompts])] == \
        [Engine(model).generate([Request(p, 40)])[0].token_ids for p in prompts]
    assert 0 < batch.last_stats.accepted < batch.last_stats.drafted  # both branches were taken
    assert stats.tokens_per_forward == 1 + stats.acceptance_rate


def test_verify_emits_the_target_distribution():
    """Unit level: whatever the draft distribution, the first emitted token follows p."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    n = 8000
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=gen))
        tokens, _ = verify(torch.stack([p, p]), q[None], [draft], gen)
        counts[tokens[0]] += 1
    assert counts[4] == 0
    assert chi_square_p(counts[:4], p[:4]) > 1e-4
    assert chi_square_p(counts[:4], q[:4] / q[:4].sum()) < 1e-6  # the test can tell p from q


def exact_pair_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) = sum_t1 P(t1) P(t2 | t1) P(t3 | t1, t2) of plain sampling, by brute force: [V, V]."""
    V = model.config.vocab_size
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (t1, t2)
    seqs = torch.cat([torch.tensor(prompt).expand(V * V, -1), grid], dim=1)
    with torch.no_grad():
        logits = model(seqs)
    p1 = probabilities(logits[0, len(prompt) - 1], params)  # [V]
    p2 = probabilities(logits[:, len(prompt)], params).view(V, V, V)[:, 0]  # [t1, t2]
    p3 = probabilities(logits[:, len(prompt) + 1], params).view(V, V, V)  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0)  # [t2, t3]


def test_speculative_sampling_preserves_the_distribution():
    model = tiny_model(vocab=6, gain=2.0, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = [1, 4, 2]
    n = 3000
    engine = Engine(model, speculative=True)
    requests = [Request(prompt, 3, SamplingParams(1.0, top_p=0.95, seed=i)) for i in range(n)]
    results = engine.generate(requests)
    rate = engine.last_stats.acceptance_rate
    assert 0.2 < rate < 0.95  # drafts are both accepted and rejected often
    counts = torch.zeros(6, 6)
    for r in results:
        counts[r.token_ids[1], r.token_ids[2]] += 1
    exact = exact_pair_distribution(model, prompt, params)
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3
    # same seed, same tokens
    again = engine.generate([Request(prompt, 3, SamplingParams(1.0, top_p=0.95, seed=7))])[0]
    assert again.token_ids == results[7].token_ids
