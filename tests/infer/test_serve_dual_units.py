"""Pieces of dual micro-batch decode that need no processes: the model's generator seam (one forward, hooks
still seen), the engine's split decode step against one forward, and the order in which a forward that is
not split issues its exchange beside an empty partner (the order every other rank's pair issues)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_model  # noqa: E402
from dsv3.infer.cluster.lockstep import _alongside  # noqa: E402
from dsv3.infer.engine import Engine, Request  # noqa: E402
from dsv3.model.dispatch import run  # noqa: E402
from dsv3.parallel.overlap import run_interleaved  # noqa: E402


def test_hidden_states_run_the_generator_and_hooked_modules_still_see_their_calls():
    """hidden_states is run(hidden_steps); a Block or MoE with a hook (a study's hook, FSDP's) is called as a
    module, so the hook fires, and the result is the same."""
    model = tiny_model(layers=3)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.inference_mode():
        plain = model.hidden_states(ids)
        assert torch.equal(run(model.hidden_steps(ids)), plain)
        seen = []
        handles = [model.main_layers[1].register_forward_pre_hook(lambda m, args: seen.append("block")),
                   model.main_layers[2].mlp.register_forward_hook(lambda m, args, out: seen.append("moe"))]
        hooked = model.hidden_states(ids)
        for h in handles:
            h.remove()
    assert seen == ["block", "moe"]
    assert torch.equal(hooked, plain)


def _requests() -> list[Request]:
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1, 2], [3, 3, 3, 3], [11], [40, 41, 42, 43, 44]]
    return [Request(p, n) for p, n in zip(prompts, [10, 12, 7, 9, 11, 5], strict=True)]


@pytest.mark.parametrize("speculative", [False, True])
def test_decode_in_two_halves_gives_the_tokens_of_one_forward(speculative):
    """Five, then fewer rows (odd and even counts, left padding, rows leaving), MTP verify steps split too."""
    model = tiny_model(layers=3)
    want = [r.token_ids for r in Engine(model, speculative=speculative, fast=False).generate(_requests())]
    engine = Engine(model, speculative=speculative)
    engine.micro_batches = 2
    calls = []
    engine.drive = lambda steps: calls.append(len(steps)) or run_interleaved(steps)
    assert [r.token_ids for r in engine.generate(_requests())] == want
    assert calls and set(calls) == {2}


def _exchange(log: list, name: str, steps: int):
    """A fake exchange: issues a collective per step (logged), then yields while it is in flight."""
    for k in range(steps):
        log.append(f"{name}{k}")
        yield
    return name


def test_a_forward_beside_an_empty_partner_issues_in_the_order_of_two_interleaved_halves():
    def layer(log, name, dispatch_steps, partner=None):  # dispatch, experts, combine (as MoE.steps does)
        yield from _alongside(_exchange(log, name + ".d", dispatch_steps), partner)
        log.append(name + ".experts")
        yield from _alongside(_exchange(log, name + ".c", 2), partner)
        if partner is not None:
            run(partner)

    def empty(log, name):
        yield from _exchange(log, name + ".d", 6)
        log.append(name + ".experts")
        yield from _exchange(log, name + ".c", 2)

    paired, interleaved = [], []
    run(layer(paired, "a", 6, empty(paired, "b")))
    run_interleaved([layer(interleaved, "a", 6), empty(interleaved, "b")])
    assert paired == interleaved
    assert paired[:4] == ["a.d0", "b.d0", "a.d1", "b.d1"]
