"""The data-parallel axis: how the copies of a parameter on the ranks of one mesh group become one update.

Every trainable parameter of this rank belongs to one `Replicas` set: the ranks holding the same copy of it
and the divisor that turns the sum of their gradients into the single-process step's gradient.

* the **dense** parameters (attention, dense MLPs, shared experts, router, embedding, head, MTP) are
  copied over the stage's ``dp`` replicas;
* an EP rank's **routed experts** are copied over its ``ep_replicate`` group only (the dispatcher's backward
  has already summed the gradient over the EP group's tokens).

The divisor is the number of data-parallel replicas when each rank's loss is the mean over its own tokens,
and 1 under a pipeline, whose losses are weighted by their share of the global batch.

Three ways to treat a set, one per ``--dp-shard``:

* `Replicate` (``none``): one flat all-reduce per set after backward, every rank updates its copy alike;
* `Zero1` (``zero1``, ZeRO stage 1): each parameter has one owner in its set, which alone receives the
  summed gradient, keeps AdamW state and updates; the owners then broadcast (`OwnerSharding`);
* `FSDP` (``fsdp``): FSDP2's ``fully_shard`` over the ``dp`` mesh for the dense parameters (DTensor shards of
  parameters, gradients and AdamW state); the routed experts, which it ignores, are replicated as above.

Each also says which of its tensors this rank *counts*, so that a sum over the world (the gradient norm for
clipping, the parameter count) meets every parameter of the model exactly once: the first rank of a
replicated set, a ZeRO-1 owner, every FSDP shard.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsv3.parallel.memory import local_tensor


@dataclass
class Replicas:
    """``params`` (the same list, in the same order, on every member) copied over the global ``ranks`` of
    ``group`` (None: trivial); the sum of their gradients over the group, divided by ``divisor``, is the
    single-process step's gradient."""

    params: list[nn.Parameter]
    ranks: list[int]
    group: dist.ProcessGroup | None
    divisor: int

    @property
    def first(self) -> int:
        return self.ranks[0]


def zero_missing_grads(params: list[nn.Parameter]) -> None:
    """A zero gradient where none was computed (an expert no token reached, a stage's unused copy), so
    that every member of a set takes part in its collectives with the same tensors."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def flat_sum(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int = 1) -> None:
    """All-reduce (sum) ``grads`` over ``group`` as one flat fp32 buffer, then divide by ``divisor``."""
    if not grads:
        return
    if (group is None or dist.get_world_size(group) == 1) and divisor == 1:
        return
    flat = torch.cat([local_tensor(g).reshape(-1).float() for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat /= divisor
    for g, part in zip(grads, flat.split([g.numel() for g in map(local_tensor, grads)]), strict=True):
        local_tensor(g).copy_(part.view_as(local_tensor(g)))


class Replicate:
    """Every rank keeps and updates its whole copy; gradients summed over each set after backward."""

    def __init__(self, sets: list[Replicas]):
        self.sets = sets

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the sum runs once per step, in `reduce`

    def reduce(self) -> None:
        for s in self.sets:
            zero_missing_grads(s.params)
            flat_sum([p.grad for p in s.params], s.group, s.divisor)

    def counted(self) -> list[nn.Parameter]:
        me = _rank()
        return [p for s in self.sets if s.first == me for p in s.params]

    def updated(self) -> list[nn.Parameter]:
        return [p for s in self.sets for p in s.params]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass


def assign_owners(params: list[nn.Parameter], ranks: int) -> list[int]:
    """The rank that owns each parameter: largest first onto the least loaded rank (ties: lowest rank), so
    every rank holds about 1/ranks of the elements. The same on every rank (a pure function of shapes)."""
    load = [0] * ranks
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += params[i].numel()
    return owners


class OwnerSharding:
    """ZeRO-1 over one `Replicas` set: each parameter has one owner among the set's ranks, which alone
    receives its gradient (the members' sum divided by the divisor), keeps AdamW state for it and updates
    it; the owners then broadcast the updated parameters. Every collective is one flat tensor per owner and
    dtype, in a fixed order, so a resumed run repeats the same sums bit for bit."""

    def __init__(self, replicas: Replicas):
        self.set = replicas
        self.owners = [replicas.ranks[i] for i in assign_owners(replicas.params, len(replicas.ranks))]
        self.rank = _rank()

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and keeps AdamW state for)."""
        return [p for p, r in zip(self.set.params, self.owners, strict=True) if r == self.rank]

    def _by_owner(self) -> Iterator[tuple[int, list[nn.Parameter]]]:
        """(owner, its parameters of one dtype), in the same order on every rank."""
        for owner in self.set.ranks:
            mine = [p for p, r in zip(self.set.params, self.owners, strict=True) if r == owner]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                yield owner, [p for p in mine if p.dtype == dtype]

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Each gradient summed onto its owner and divided; the other ranks drop theirs."""
        for owner, params in self._by_owner():
            self._reduce_to_owner(owner, params)

    def _reduce_to_owner(self, owner: int, params: list[nn.Parameter]) -> None:
        """One flat sum onto ``owner`` of the gradients and of flags saying which exist, so that a parameter
        no rank computed a gradient for keeps none (AdamW then skips it, as in one process)."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype,
                             device=params[0].device)
        flat = torch.cat([*parts, flags])
        if len(self.set.ranks) > 1:
            dist.reduce(flat, dst=owner, group=self.set.group)
        if owner != self.rank:
            for p in params:
                p.grad = None
            return
        *chunks, seen = flat.split([*(p.numel() for p in params), len(params)])
        for p, chunk, flag in zip(params, chunks, seen.tolist(), strict=True):
            p.grad = chunk.view_as(p).div_(self.set.divisor) if flag else None

    @torch.no_grad()
    def broadcast_updates(self) -> None:
        """One flat broadcast per owner (and dtype): every member ends the step with the same parameters."""
        if len(self.set.ranks) == 1:
            return
        for owner, params in self._by_owner():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=owner, group=self.set.group)
            if owner != self.rank:
                for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(chunk.view_as(p))


class Zero1:
    """ZeRO-1 over every set: AdamW state exists once per parameter over the whole world. No DDP: its
    buckets are rebuilt after the first step and sum differently in a resumed run's first step; the owners'
    flat reductions do not."""

    def __init__(self, sets: list[Replicas], zero_fill: bool):
        self.shardings = [OwnerSharding(s) for s in sets]
        self.zero_fill = zero_fill

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reduce(self) -> None:
        for sharding in self.shardings:
            if self.zero_fill:
                zero_missing_grads(sharding.set.params)
            sharding.reduce_grads()

    def counted(self) -> list[nn.Parameter]:
        return self.updated()

    def updated(self) -> list[nn.Parameter]:
        """A rank updates (and loads optimizer state for) the parameters it owns only."""
        return [p for s in self.shardings for p in s.owned()]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step the owners share their updated parameters."""
        def share(*_):
            for s in self.shardings:
                s.broadcast_updates()

        optimizer.register_step_post_hook(share)


class FSDP:
    """FSDP2 on the dense parameters (``shard_model``: sharded over the ``dp`` mesh, reduce-scattered in
    backward), the routed experts replicated over their sets as by `Replicate`."""

    def __init__(self, model: nn.Module, experts: Replicate, units: list[nn.Module]):
        self.model, self.experts, self.units = model, experts, units

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients of a micro-step that is not the step's last stay unsharded and unreduced."""
        return fsdp_no_sync(self.units)

    def reduce(self) -> None:
        self.experts.reduce()  # the dense ones were reduce-scattered in backward

    def counted(self) -> list[nn.Parameter]:
        experts = {id(p) for p in self.experts.updated()}
        return [p for p in self.updated() if id(p) not in experts] + self.experts.counted()

    def updated(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass


def shard_units(units: list[nn.Module], mesh, ignored: set[nn.Parameter], divide_factor: float | None) -> None:
    """``fully_shard`` each of ``units`` in order (inner ones first: a unit's parameters are those not
    already in an earlier unit) over the one-dimensional ``mesh`` (None: the world), leaving ``ignored``
    parameters plain. ``divide_factor`` 1: gradients summed over the replicas instead of averaged."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params=ignored)
        if divide_factor is not None:
            unit.set_gradient_divide_factor(divide_factor)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


@contextlib.contextmanager
def fsdp_no_sync(units: list[nn.Module]) -> Iterator[None]:
    """FSDP2's gradient sync off for one micro-step's backward (gradients accumulate unsharded)."""
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


@torch.no_grad()
def clip_by_global_norm(params: list[nn.Parameter], counted: list[nn.Parameter], max_norm: float,
                        device: torch.device) -> float:
    """Clip the gradients of ``params`` (this rank's) by the norm of the whole model's gradient, where
    ``counted`` are the tensors this rank counts (each parameter of the model counted by exactly one rank
    of the world, DTensor shards by their local part); returns the norm before clipping. A collective over
    the world: the one clip of every layout. Each rank's part is torch's own ``get_total_norm`` and the
    factor torch's ``clip_grad_norm_`` takes, so one process clips exactly as torch does."""
    grads = [local_tensor(p.grad) for p in counted if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads).to(device=device, dtype=torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, total)
        total = torch.linalg.vector_norm(torch.stack(parts))
    norm = float(total)
    if math.isfinite(norm) and norm > max_norm:
        factor = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                local_tensor(p.grad).mul_(factor.to(p.grad.device))
    return norm


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the whole world, in place; returns t."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
