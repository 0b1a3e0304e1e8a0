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
any layout. Sharding combined with expert parallelism is refused.
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
    """Refuse the sharded layouts that do not exist: with expert parallelism, or with one process."""
    if layout.ep > 1:
        raise DSV3Error(
            f"--dp-shard {layout.dp_shard} with --ep {layout.ep} is not implemented; use one of them"
        )
    if layout.dp < 2:
        raise DSV3Error(
            f"--dp-shard {layout.dp_shard} shards over the data-parallel processes but only one is running; "
            "start several with torchrun --nproc-per-node N -m dsv3 train ..."
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


class Zero1Parallelized(Parallelized):
    """ZeRO-1: each parameter's gradient is summed onto the rank that owns it, which alone keeps AdamW state
    for it and updates it; the owners then broadcast the updated parameters. No DDP: the reduction is one
    flat ``reduce`` per owner in a fixed order, so a resumed run repeats the same sums bit for bit (DDP
    rebuilds its buckets after the first step and so sums differently in a resumed run's first step)."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__(model, layout)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owners = assign_owners(self.params, self.world)
        self.rank = dist.get_rank()

    def _wrap(self, step: LossStep) -> nn.Module:
        return step

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and keeps AdamW state for)."""
        return [p for p, r in zip(self.params, self.owners, strict=True) if r == self.rank]

    def updated_parameters(self) -> list[nn.Parameter]:
        """A resumed rank loads optimizer state for its own parameters only."""
        return self.owned()

    def _groups(self) -> Iterator[tuple[int, list[nn.Parameter]]]:
        """(owner, its parameters of one dtype), in the same order on every rank."""
        for owner in range(self.world):
            mine = [p for p, r in zip(self.params, self.owners, strict=True) if r == owner]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                yield owner, [p for p in mine if p.dtype == dtype]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step the owners share their updated parameters."""
        optimizer.register_step_post_hook(lambda *_: self._broadcast_updates())

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """Average each gradient onto its owner (other ranks drop theirs), then clip by the global norm: the
        sum over ranks of each one's owned gradients."""
        for owner, group in self._groups():
            self._reduce_to_owner(owner, group)
        grads = [p.grad for p in self.owned() if p.grad is not None]
        device = next(self.model.parameters()).device
        sq = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))
        norm = float(self.sum_(sq).sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def _reduce_to_owner(self, owner: int, group: list[nn.Parameter]) -> None:
        """One flat sum onto ``owner`` of the group's gradients and of flags saying which exist, so that a
        parameter no rank computed a gradient for keeps none (AdamW then skips it, as in one process)."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in group]
        flags = torch.tensor([float(p.grad is not None) for p in group], dtype=group[0].dtype,
                             device=group[0].device)
        flat = torch.cat([*parts, flags])
        dist.reduce(flat, dst=owner)
        if owner != self.rank:
            for p in group:
                p.grad = None
            return
        sizes = [p.numel() for p in group]
        *chunks, seen = flat.split([*sizes, len(group)])
        for p, chunk, flag in zip(group, chunks, seen.tolist(), strict=True):
            p.grad = chunk.view_as(p).div_(self.world) if flag else None

    @torch.no_grad()
    def _broadcast_updates(self) -> None:
        """One flat broadcast per owner (and dtype): every rank ends the step with the same parameters."""
        for owner, group in self._groups():
            flat = torch.cat([p.detach().reshape(-1) for p in group])
            dist.broadcast(flat, src=owner)
            if owner != self.rank:
                for p, chunk in zip(group, flat.split([p.numel() for p in group]), strict=True):
                    p.copy_(chunk.view_as(p))


class FSDPParallelized(Parallelized):
    """FSDP2 over the data-parallel ranks: every parameter, its gradient and its AdamW state are sharded."""

    def _wrap(self, step: LossStep) -> nn.Module:
        """Shard each main Block, then the root; LossStep calls ``model.loss``, registered as a forward."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for block in self.model.main_layers:
            fully_shard(block)
        fully_shard(self.model)
        register_fsdp_forward_method(self.model, "loss")
        return step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of a micro-batch that is not the step's last stay unsharded and unreduced."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @torch.no_grad()
    def sync_and_clip(self, max_norm: float) -> float:
        """The gradients are already reduce-scattered; the global norm adds every rank's shard."""
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        device = next(self.model.parameters()).device
        sq = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))
        norm = float(self.sum_(sq.to(device)).sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """A plain single-process `Transformer` on every rank (all ranks must call it): each parameter is
        all-gathered (torch.distributed.checkpoint's full state dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from dsv3.model.transformer import Transformer

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            full = Transformer(self.model.config)
        full.load_state_dict(state, strict=True, assign=True)
        device = next(iter(state.values())).device
        full.init_buffers(device)
        return full.train(self.model.training)

    def parameter_count(self) -> int:
        """Every parameter's global size (a DTensor reports it)."""
        return sum(p.numel() for p in self.model.parameters())

    def windows_for_eval(self, windows: list[int]) -> list[int]:
        """Every Block forward all-gathers, so every rank must run as many (`equal_share`)."""
        return equal_share(windows, self.world)
