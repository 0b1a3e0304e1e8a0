"""The optimizer step: micro-batches, backward, clipping, the non-finite guard, AdamW, and the
aux-loss-free bias update from the expert loads of the whole global batch."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dsv3.data.packing import PackedSequences, SampleOrder
from dsv3.errors import DSV3Error
from dsv3.train.distributed import World


@dataclass
class RunState:
    """Where the run is; saved in every checkpoint."""

    step: int = 0  # optimizer steps done (skipped ones included)
    samples: int = 0  # sequences consumed over all ranks: the data position
    tokens: int = 0  # training tokens consumed
    bad_in_a_row: int = 0  # consecutive steps skipped for a non-finite loss or gradient
    skipped: int = 0
    train_seconds: float = 0.0  # time inside steps, for the average throughput


class LossStep(nn.Module):
    """``model.loss`` as a forward, so that DDP's gradient hooks see it; returns detached parts too."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.loss(input_ids, labels)
        zero = out.loss.new_zeros(())
        parts = torch.stack(
            [
                out.loss.detach().float(),
                out.lm_loss.detach().float(),
                (out.mtp_loss if out.mtp_loss is not None else zero).detach().float(),
                (out.balance_loss if out.balance_loss is not None else zero).detach().float(),
            ]
        )
        return out.loss, parts  # parts: [total, lm, mtp, balance]


def wrap_for_training(model: nn.Module, world: World, expert_parallel: bool = False) -> nn.Module:
    """LossStep, inside DDP when there are several ranks (without DDP under expert parallelism, which
    syncs its own gradients). Buffers are not broadcast: each rank counts its own expert loads, and the
    router biases stay equal because every rank applies the same update."""
    step = LossStep(model)
    if not world.distributed or expert_parallel:
        return step
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return DistributedDataParallel(step, device_ids=device_ids, broadcast_buffers=False)


class StepRunner:
    """One optimizer step over a global batch of ``batch_size`` sequences."""

    def __init__(
        self,
        model: nn.Module,
        wrapped: nn.Module,
        optimizer,
        scheduler,
        data: PackedSequences,
        order: SampleOrder,
        world: World,
        batch_size: int,
        grad_accum: int,
        grad_clip: float,
        autocast,
        expert_parallel: bool = False,
    ):
        if batch_size % (world.size * grad_accum):
            raise DSV3Error(
                f"--batch-size ({batch_size}) must be a multiple of the number of processes "
                f"({world.size}) times --grad-accum ({grad_accum})"
            )
        self.model, self.wrapped, self.optimizer, self.scheduler = model, wrapped, optimizer, scheduler
        self.data, self.order, self.world = data, order, world
        self.batch_size, self.grad_accum, self.grad_clip = batch_size, grad_accum, grad_clip
        self.per_rank = batch_size // (world.size * grad_accum)
        self.autocast, self.expert_parallel = autocast, expert_parallel
        self.params = [p for p in model.parameters() if p.requires_grad]

    def micro_batches(self, samples: int) -> list[list[int]]:
        """This rank's window indices for each micro-step: micro-step j takes the j-th slice of the
        global batch, and rank r the r-th part of it, so the global batch does not depend on the
        number of processes."""
        idx = self.order.indices(samples, self.batch_size)
        chunk = self.per_rank * self.world.size
        out = []
        for j in range(self.grad_accum):
            micro = idx[j * chunk : (j + 1) * chunk]
            out.append(micro[self.world.rank * self.per_rank : (self.world.rank + 1) * self.per_rank])
        return out

    def run(self, state: RunState) -> dict[str, Any]:
        """Do step ``state.step + 1``; advances ``state`` and returns the metrics row."""
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        parts = self._forward_backward(self.micro_batches(state.samples))
        grad_norm = self._sync_and_clip()
        finite = math.isfinite(parts[0]) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            loads = self._global_expert_loads()
            imbalance = self.model.update_router_biases()
            state.bad_in_a_row = 0
        else:
            loads, imbalance = self._discard_expert_loads(), []
            state.bad_in_a_row += 1
            state.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        dt = time.perf_counter() - t0
        tokens = self.batch_size * self.data.seq_len
        state.step += 1
        state.samples += self.batch_size
        state.tokens += tokens
        state.train_seconds += dt
        return {
            "kind": "train",
            "step": state.step,
            "loss": parts[1],
            "total_loss": parts[0],
            "mtp_loss": parts[2],
            "balance_loss": parts[3],
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / dt,
            "tokens": state.tokens,
            "epoch": self.order.epoch_of(state.samples),
            "skipped": not finite,
            "expert_imbalance": imbalance,
            "expert_load": loads,
        }

    def _forward_backward(self, micro: list[list[int]]) -> list[float]:
        """Backward of the mean loss over the global batch; returns its parts averaged over ranks."""
        sums = torch.zeros(4, dtype=torch.float64)
        for j, indices in enumerate(micro):
            inputs, labels = self.data.batch(indices)
            last = j == len(micro) - 1
            sync = contextlib.nullcontext() if last or not self.world.distributed else self.wrapped.no_sync()
            with sync:
                with self.autocast:
                    loss, parts = self.wrapped(inputs.to(self.world.device), labels.to(self.world.device))
                (loss / self.grad_accum).backward()
            sums += parts.double().cpu()
        total = self.world.sum_(sums.to(self.world.device)).cpu() / (self.world.size * self.grad_accum)
        return total.tolist()

    def _sync_and_clip(self) -> float:
        """Gradient norm before clipping (DDP has already averaged the gradients over ranks)."""
        if self.expert_parallel:
            from dsv3.train.expert_parallel import sync_and_clip

            return sync_and_clip(self.model, self.grad_clip, self.world)
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))

    def _global_expert_loads(self) -> list[list[int]]:
        """Sum every MoE layer's token counts over ranks (so all ranks update the biases alike); an
        expert-parallel layer has counted the whole EP group already."""
        loads = []
        for moe in self.model.moe_layers():
            if not self.expert_parallel:
                self.world.sum_(moe.expert_load)
            loads.append([int(x) for x in moe.expert_load.tolist()])
        return loads

    def _discard_expert_loads(self) -> list[list[int]]:
        for moe in self.model.moe_layers():
            moe.expert_load.zero_()
        return []
