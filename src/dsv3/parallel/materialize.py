"""A model built on the ``meta`` device and laid out (`parallelize`) given real storage for what this rank
holds, and only that, filled tensor by tensor from a source of values.

The trainer builds the whole model on ``meta`` (no memory), applies the layout (stage split, expert
placement, FSDP sharding), then materializes: a pipeline rank allocates only its stages' tensors, an EP rank
only its routed experts, an FSDP rank only its rows of each sharded tensor. The values come from a
`Values` source asked for each piece by its whole-model name (the keys of `dsv3.parallel.checkpoint`:
routed experts one key per expert), so one source serves every layout: a fresh run's seeded values
(`dsv3.model.init`), or a checkpoint read piece by piece (`dsv3.checkpoint.CheckpointValues`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.parallel.checkpoint import expert_rules, local_rows, tensor_pieces
from dsv3.parallel.ep import ExpertParallelDispatcher

# (whole-model key, the whole tensor's shape, the rows of dim 0 wanted or None for all) -> those values
Values = Callable[[str, tuple[int, ...], slice | None], torch.Tensor]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, values: Values) -> None:
    """Allocate this rank's share of ``model`` (built on ``meta``, laid out) on ``device`` and fill every
    persistent tensor from ``values``; then the non-persistent buffers (RoPE, expert-load counters, the
    EP dispatchers' expert ids), which no source holds."""
    _to_empty_in_place(model, device)
    for d in (m for m in model.modules() if isinstance(m, ExpertParallelDispatcher)):
        d.expert_ids = d.placement.rank_experts(d.groups.rank).clone().to(device)
    rules = expert_rules(model)
    for name, t in model.state_dict(keep_vars=True).items():
        if name in rules:
            _fill_experts(name, t, rules, values)
        else:
            _fill(name, t, values)
    model.init_buffers(device)


def _to_empty_in_place(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` keeping every Parameter object (its tensor swapped in place): the layout's
    parameter sets (data-parallel replicas, tied pipeline copies) hold the objects they were given."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _fill(key: str, t: torch.Tensor, values: Values) -> None:
    """A plain tensor whole, or a DTensor's local rows (FSDP shards dim 0)."""
    local, first = local_rows(t)
    rows = None if local.shape == t.shape else slice(first, first + local.shape[0])
    local.copy_(_checked(key, values(key, tuple(t.shape), rows), local.shape))


def _fill_experts(name: str, t: torch.Tensor, rules, values: Values) -> None:
    """Stacked routed experts: each held expert (every slot holding it) from its own key."""
    local = local_rows(t)[0]
    for key, part, rows in tensor_pieces(name, t, rules):
        value = _checked(key, values(key, tuple(part.shape), None), part.shape)
        for r in rows:
            local[r].copy_(value)


def _checked(key: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise DSV3Error(f"{key}: the source gives shape {tuple(value.shape)}, this rank holds {tuple(shape)}")
    return value
