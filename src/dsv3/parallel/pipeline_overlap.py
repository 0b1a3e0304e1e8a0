"""DualPipeV's overlapped forward-backward step (``OVERLAP_F_B``) as a registered custom function.

`torch.distributed.pipelining`'s DualPipeV schedule emits ``OVERLAP_F_B`` actions: the forward of one
micro-batch on one stage paired with the full backward of another micro-batch on the rank's other stage.
Without a registered function the runtime runs the pair one after the other. The schedule's
``register_custom_function(OVERLAP_F_B, fn)`` hands ``fn(action, ctx)`` the pair (``action.sub_actions``)
and a context (the schedule, the micro-batch args/kwargs/targets); the function must then do the
runtime's own bookkeeping for both halves: wait for the received activations or gradients, run the
stage, compute the loss on the last stage, pass outputs between the rank's two stages, count backwards
for the last-backward flag. That bookkeeping reads the schedule's private fields (``fwd_recv_ops``,
``bwd_recv_ops``, ``backward_counter``, ``_maybe_compute_loss``), as torchtitan's DualPipeV overlap does;
it is written once here, so that what overlaps is one small function: ``overlap(forward, backward)``
receives the two halves as thunks. `run_in_order` runs them one after the other (the reference);
`run_concurrently` runs them at once, so that the MoE dispatch/combine of one half is in flight while the
other half computes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action, _PipelineContext, _wait_batch_p2p

Overlap = Callable[[Callable[[], None], Callable[[], None]], None]


def run_in_order(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """No overlap: the forward half, then the backward half."""
    forward()
    backward()


def run_concurrently(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """V3's overlap: the backward half on a helper thread while the forward half runs here (where the
    caller's autocast lives; autocast is per thread and a backward needs none). Whenever one half waits on
    an all-to-all (its MoE dispatch or combine, forward or backward: torch releases the GIL while waiting)
    the other half computes. The two halves run different stages, whose MoE layers talk over different
    process groups (`dsv3.parallel.pipeline_ep`), so each group still sees its collectives in one order.
    An exception in either half is raised here, after both have stopped."""
    errors: list[BaseException] = []
    threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the helper takes the caller's

    def run_backward() -> None:
        try:
            torch.set_num_threads(threads)
            backward()
        except BaseException as err:  # handed to the caller's thread below
            errors.append(err)

    helper = threading.Thread(target=run_backward, name="dsv3-overlap-backward", daemon=True)
    helper.start()
    try:
        forward()
    finally:
        helper.join()
    if errors:
        raise errors[0]


def register_overlap(schedule, overlap: Overlap = run_in_order) -> None:
    """Makes ``schedule`` (a DualPipeV schedule) run every ``OVERLAP_F_B`` pair through ``overlap``."""

    def overlapped_f_b(action: _Action, ctx: _PipelineContext) -> None:
        stages = {stage.stage_index: stage for stage in schedule._stages}
        forward_action, backward_action = action.sub_actions
        overlap(lambda: _forward(schedule, stages, forward_action, ctx),
                lambda: _backward(schedule, stages, backward_action))

    schedule.register_custom_function(OVERLAP_F_B, overlapped_f_b)


def _forward(schedule, stages: dict, action: _Action, ctx: _PipelineContext) -> None:
    """The runtime's FORWARD action: wait for the input, run the stage, loss on the last stage, hand
    the output to the rank's next stage (the V's turn)."""
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_first and index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if index + 1 in stages:
        stages[index + 1].set_local_fwd_input(output, mb)


def _backward(schedule, stages: dict, action: _Action) -> None:
    """The runtime's FULL_BACKWARD action: wait for the output gradient, backward, hand the input
    gradient to the rank's previous stage."""
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_last and index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[index] += 1
    last = schedule.backward_counter[index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
