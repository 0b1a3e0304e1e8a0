"""The optimizer step: micro-batches, backward, clipping, the non-finite guard, AdamW, and the
aux-loss-free bias update from the expert loads of the whole global batch. Whatever the layout, the step
talks to one `Parallelized` object (``dsv3.parallel.parallelize``) for everything that differs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from dsv3.data.packing import PackedSequences, SampleOrder
from dsv3.errors import DSV3Error
from dsv3.parallel.parallelize import Parallelized
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


class StepRunner:
    """One optimizer step over a global batch of ``batch_size`` sequences."""

    def __init__(
        self,
        parallel: Parallelized,
        optimizer,
        scheduler,
        data: PackedSequences,
        order: SampleOrder,
        world: World,
        batch_size: int,
        grad_accum: int,
        grad_clip: float,
        autocast,
    ):
        ranks = parallel.data_size  # the data-parallel ranks (all processes, but for pipeline stages)
        if batch_size % (ranks * grad_accum):
            raise DSV3Error(
                f"--batch-size ({batch_size}) must be a multiple of the number of data-parallel processes "
                f"({ranks}) times --grad-accum ({grad_accum})"
            )
        self.parallel, self.model = parallel, parallel.model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.data, self.order, self.world = data, order, world
        self.batch_size, self.grad_accum, self.grad_clip = batch_size, grad_accum, grad_clip
        self.per_rank = batch_size // (ranks * grad_accum)
        parallel.check_batch(self.per_rank)
        self.autocast = autocast

    def micro_batches(self, samples: int) -> list[list[int]]:
        """This rank's window indices for each micro-step: micro-step j takes the j-th slice of the
        global batch, and rank r the r-th part of it, so the global batch does not depend on the
        number of processes."""
        idx = self.order.indices(samples, self.batch_size)
        chunk = self.per_rank * self.parallel.data_size
        rank = self.parallel.data_rank
        out = []
        for j in range(self.grad_accum):
            micro = idx[j * chunk : (j + 1) * chunk]
            out.append(micro[rank * self.per_rank : (rank + 1) * self.per_rank])
        return out

    def run(self, state: RunState) -> dict[str, Any]:
        """Do step ``state.step + 1``; advances ``state`` and returns the metrics row."""
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        parts = self._forward_backward(self.micro_batches(state.samples))
        grad_norm = self.parallel.sync_and_clip(self.grad_clip)
        finite = math.isfinite(parts[0]) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            loads = self._global_expert_loads()
            imbalance = self.parallel.update_router_biases()
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
        """Backward of the mean loss over the global batch, by the layout; returns its parts averaged."""
        device = self.world.device
        batches = [tuple(t.to(device) for t in self.data.batch(indices)) for indices in micro]
        return self.parallel.forward_backward(batches, self.autocast, self.grad_accum)

    def _global_expert_loads(self) -> list[list[int]]:
        """Every MoE layer's token counts summed over the data-parallel ranks (so all ranks update the
        biases alike)."""
        self.parallel.reduce_expert_loads()
        return self.parallel.expert_loads()

    def _discard_expert_loads(self) -> list[list[int]]:
        for moe in self.model.moe_layers():
            moe.expert_load.zero_()
        return []
