"""When the server's decode thread hands a step's events to the HTTP thread: just before its next kernel call
where a CPU is spare (the HTTP thread's Python then runs while the kernels hold no GIL), right after the step
where the kernels' threads fill every CPU (the HTTP thread would stop one of them mid-step)."""

from __future__ import annotations

import time

import pytest

from dsv3.infer.engine import Batch, Engine, Request
from dsv3.infer.sampling import GREEDY
from dsv3.infer.scheduler import Scheduler
from dsv3.kernels import decode_kernels as dk

pytestmark = pytest.mark.skipif(not dk.block_kernel_available(), reason="needs the C decode kernels")


@pytest.fixture
def kernel_calls(monkeypatch):
    """A list that gets "kernel" at every decode_step / decode_block call, after ``before_next_call``'s turn."""
    order: list[str] = []
    real_step, real_block = dk._block_functions()[2], dk._block_functions()[0]
    functions = list(dk._block_functions())
    functions[2] = lambda *a: order.append("kernel") or real_step(*a)
    functions[0] = lambda *a: order.append("kernel") or real_block(*a)
    monkeypatch.setattr(dk, "_block_functions", lambda: tuple(functions))
    return order


def test_before_next_call_runs_once_just_before_the_kernels(model, kernel_calls):
    engine = Engine(model, eos_token_ids=frozenset())
    batch = engine.start([Request([5, 6, 7], 8, GREEDY)])
    kernel_calls.clear()
    with dk.before_next_call(lambda: kernel_calls.append("hand-over")):
        batch.step()
        batch.step()
    assert kernel_calls[0] == "hand-over" and kernel_calls.count("hand-over") == 1 and "kernel" in kernel_calls
    with dk.before_next_call(lambda: kernel_calls.append("at exit")):
        pass
    assert kernel_calls[-1] == "at exit"
    batch.release()


@pytest.mark.parametrize("spare", [True, False])
def test_the_scheduler_hands_over_before_the_next_kernel_call_only_with_a_spare_cpu(model, kernel_calls,
                                                                                   monkeypatch, spare):
    steps = []
    real = Batch.step
    monkeypatch.setattr(Batch, "step", lambda self, *a, **kw: kernel_calls.append("step") or steps.append(1)
                        or real(self, *a, **kw))
    monkeypatch.setattr(Scheduler, "_spare_core", lambda self: spare)
    scheduler = Scheduler(Engine(model, eos_token_ids=frozenset()))
    request, done = Request([5, 6, 7], 6, GREEDY), []
    scheduler.start()
    try:
        scheduler.pending.put((request, lambda ev: kernel_calls.append("event") or done.append(ev.finish_reason)))
        deadline = time.time() + 60
        while not any(done) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert any(done)
    # the events of the first step, and where they went relative to the second step's kernel call
    second = [i for i, item in enumerate(kernel_calls) if item == "step"][1]
    after = kernel_calls[second:]
    if spare:
        assert after[:3] == ["step", "event", "kernel"]
    else:
        assert kernel_calls[second - 1] == "event" and after[:2] == ["step", "kernel"]
