"""Sharded data parallelism: ``Layout(dp=D, dp_shard="zero1" | "fsdp")``.

* ``zero1`` (ZeRO stage 1): each rank owns 1/D of the parameters (whole tensors, balanced by size) and its
  AdamW keeps state for those only. Each gradient is averaged onto its owner and dropped elsewhere (AdamW
  skips a parameter without a gradient, so no state is ever created for it); after the step every owner
  broadcasts its updated parameters. AdamW is elementwise, so the update is exactly the unsharded one:
  losses equal the single-process run's.
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every main-model Block and on the Transformer
  itself (the root: embedding, final norm, output head and the MTP modules, which read the main model's
  embedding and head and so stay with them). Parameters, gradients and AdamW state are all DTensor shards
  (1/D each); a Block's parameters are all-gathered for its forward and backward, its gradients
  reduce-scattered (averaged) after. ``Transformer.loss`` is registered as a forward method so that the
  root's parameters are gathered for the training step as for ``model(ids)``.

Checkpoints are sharded (`dsv3.parallel.checkpoint`): FSDP's DTensors and ZeRO-1's owned optimizer state
are written by the ranks that hold them, keyed by the whole model's names, so a sharded run resumes under
any layout. Sharding combined with expert parallelism is ``dsv3.parallel.sharded_ep``, built from the
pieces here (`OwnerSharding`, `shard_model`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.parallel.layout import Layout, LossStep, Parallelized, equal_share
from dsv3.parallel.memory import local_tensor


def check_sharded(layout: Layout) -> None:
    """Refuse a sharded layout of one process (there is nothing to shard over)."""
    if layout.dp < 2:
        raise DSV3Error(
            f"--dp-shard {layout.dp_shard} shards over the data-parallel processes but only one is running; "
            "start several with dsv3 launch --nproc N train ..."
        )


def sharded(model: nn.Module, layout: Layout) -> Parallelized:
    """The Parallelized object of a sharded layout."""
    return Zero1Parallelized(model, layout) if layout.dp_shard == "zero1" else FSDPParallelized(model, layout)


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
    """ZeRO-1 over one process group: each of ``params`` (the same list, in the same order, on every member
    of ``ranks``, global ranks of ``group``; None: the world) has one owner among ``ranks``, which alone
    receives its gradient (the members' sum divided by ``divisor``), keeps AdamW state for it and updates
    it; the owners then broadcast the updated parameters. Every collective is one flat tensor per owner and
    dtype, in a fixed order, so a resumed run repeats the same sums bit for bit."""

    def __init__(self, params: list[nn.Parameter], ranks: list[int], group: dist.ProcessGroup | None,
                 divisor: int):
        self.params, self.ranks, self.group, self.divisor = params, ranks, group, divisor
        self.owners = [ranks[i] for i in assign_owners(params, len(ranks))]
        self.rank = dist.get_rank()

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and keeps AdamW state for)."""
        return [p for p, r in zip(self.params, self.owners, strict=True) if r == self.rank]

    def _groups(self) -> Iterator[tuple[int, list[nn.Parameter]]]:
        """(owner, its parameters of one dtype), in the same order on every rank."""
        for owner in self.ranks:
            mine = [p for p, r in zip(self.params, self.owners, strict=True) if r == owner]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                yield owner, [p for p in mine if p.dtype == dtype]

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Each gradient summed onto its owner and divided by ``divisor``; the other ranks drop theirs."""
        for owner, group in self._groups():
            self._reduce_to_owner(owner, group)

    def _reduce_to_owner(self, owner: int, group: list[nn.Parameter]) -> None:
        """One flat sum onto ``owner`` of the group's gradients and of flags saying which exist, so that a
        parameter no rank computed a gradient for keeps none (AdamW then skips it, as in one process)."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in group]
        flags = torch.tensor([float(p.grad is not None) for p in group], dtype=group[0].dtype,
                             device=group[0].device)
        flat = torch.cat([*parts, flags])
        if len(self.ranks) > 1:
            dist.reduce(flat, dst=owner, group=self.group)
        if owner != self.rank:
            for p in group:
                p.grad = None
            return
        sizes = [p.numel() for p in group]
        *chunks, seen = flat.split([*sizes, len(group)])
        for p, chunk, flag in zip(group, chunks, seen.tolist(), strict=True):
            p.grad = chunk.view_as(p).div_(self.divisor) if flag else None

    def owned_grad_square_sum(self) -> torch.Tensor:
        """The sum of squares of this rank's owned gradients (fp32 scalar; add over ranks for the norm)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        grads = [p.grad for p in self.owned() if p.grad is not None]
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))

    def scale_owned_grads(self, factor: float) -> None:
        for p in self.owned():
            if p.grad is not None:
                p.grad.mul_(factor)

    @torch.no_grad()
    def broadcast_updates(self) -> None:
        """One flat broadcast per owner (and dtype): every member ends the step with the same parameters."""
        if len(self.ranks) == 1:
            return
        for owner, group in self._groups():
            flat = torch.cat([p.detach().reshape(-1) for p in group])
            dist.broadcast(flat, src=owner, group=self.group)
            if owner != self.rank:
                for p, chunk in zip(group, flat.split([p.numel() for p in group]), strict=True):
                    p.copy_(chunk.view_as(p))


def clip_scale(norm: float, max_norm: float) -> float | None:
    """The factor that clips gradients of global norm ``norm`` to ``max_norm``, or None when none is needed."""
    return max_norm / (norm + 1e-6) if math.isfinite(norm) and norm > max_norm else None


class Zero1Parallelized(Parallelized):
    """ZeRO-1: each parameter's gradient is summed onto the rank that owns it, which alone keeps AdamW state
    for it and updates it; the owners then broadcast the updated parameters (`OwnerSharding` over the
    world). No DDP: DDP rebuilds its buckets after the first step and so sums differently in a resumed
    run's first step; the owners' flat reductions do not."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        params = [p for p in model.parameters() if p.requires_grad]
        self.sharding = OwnerSharding(params, list(range(self.world)), None, self.world)

    def _wrap(self, step: LossStep) -> nn.Module:
        return step

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and keeps AdamW state for)."""
        return self.sharding.owned()

    def updated_parameters(self) -> list[nn.Parameter]:
        """A resumed rank loads optimizer state for its own parameters only."""
        return self.owned()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step the owners share their updated parameters."""
        optimizer.register_step_post_hook(lambda *_: self.sharding.broadcast_updates())

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Average each gradient onto its owner (other ranks drop theirs), then clip by the global norm: the
        sum over ranks of each one's owned gradients."""
        self.sharding.reduce_grads()
        norm = float(self.sum_(self.sharding.owned_grad_square_sum()).sqrt())
        if (factor := clip_scale(norm, max_norm)) is not None:
            self.sharding.scale_owned_grads(factor)
        return norm


class FSDPParallelized(Parallelized):
    """FSDP2 over the data-parallel ranks: every parameter, its gradient and its AdamW state are sharded."""

    def _wrap(self, step: LossStep) -> nn.Module:
        """Shard each main Block, then the root; LossStep calls ``model.loss``, registered as a forward."""
        shard_model(self.model)
        return step

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients of a micro-batch that is not the step's last stay unsharded and unreduced."""
        return fsdp_no_sync(self.model)

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """The gradients are already reduce-scattered; the global norm adds every rank's shard."""
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        device = next(self.model.parameters()).device
        sq = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))
        norm = float(self.sum_(sq.to(device)).sqrt())
        if (factor := clip_scale(norm, max_norm)) is not None:
            for g in grads:
                g.mul_(factor)
        return norm

    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """A plain single-process `Transformer` on every rank (all ranks must call it): each parameter is
        all-gathered (torch.distributed.checkpoint's full state dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return plain_model(self.model, state)

    def parameter_count(self) -> int:
        """Every parameter's global size (a DTensor reports it)."""
        return sum(p.numel() for p in self.model.parameters())

    def windows_for_eval(self, windows: list[int]) -> list[int]:
        """Every Block forward all-gathers, so every rank must run as many (`equal_share`)."""
        return equal_share(windows, self.world)


# ---- FSDP2 pieces shared with sharded expert parallelism (dsv3.parallel.sharded_ep) ------------------


def shard_model(model: nn.Module, ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2 on every main-model Block, then on the root (embedding, final norm, head, MTP modules), over the
    world; ``ignored`` parameters (an expert-parallel rank's routed experts) stay plain and unreduced.
    ``Transformer.loss`` is registered as a forward so that the root's parameters are gathered for it."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in model.main_layers:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    register_fsdp_forward_method(model, "loss")


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient sync off for one micro-batch's backward (gradients accumulate unsharded)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def plain_model(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain `Transformer` of ``model``'s config holding the full tensors ``state``, in ``model``'s mode."""
    from dsv3.model.transformer import Transformer

    with torch.device("meta"):
        full = Transformer(model.config)
    full.load_state_dict(state, strict=True, assign=True)
    full.init_buffers(next(iter(state.values())).device)
    return full.train(model.training)
