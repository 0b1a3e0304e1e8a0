"""Per-rank memory of a training step, by what holds it: parameters, gradients, optimizer state and the
activations saved for backward. Counted from the tensors themselves rather than read from an allocator,
so it means the same on CPU and GPU and shows what a layout shards (DDP's gradient buckets, all-gather
buffers and temporaries are not counted).

Activations: a ``saved_tensors_hooks`` pack hook wraps every tensor autograd saves for backward (parameters
and their views excluded: they are counted once as parameters) in a small holder that counts its storage
while alive; autograd frees the holders as backward consumes them, so the running total's maximum is the
peak of the saved-for-backward bytes over the step. Views of one storage count once. Under activation
checkpointing (``dsv3 train --ac``) torch's checkpoint hooks take the place of these inside a region: what
the meter counts there is what the region keeps, its inputs; the tensors a region's recomputation saves while
its backward runs (one region at a time) are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

FIELDS = ("parameters", "gradients", "optimizer", "activations_peak")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


class SavedTensorMeter:
    """Context manager: the peak bytes of tensors saved for backward while it is active (``peak``)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[object, int] = {}

    def _key_and_size(self, t: torch.Tensor) -> tuple[object, int]:
        try:
            storage = t.untyped_storage()
            return ("storage", storage.data_ptr(), t.device), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one storage
            return ("tensor", id(t)), tensor_bytes(t)

    def _acquire(self, key: object, size: int) -> None:
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live += size
            self.peak = max(self.peak, self.live)

    def _release(self, key: object, size: int) -> None:
        count = self._refs.pop(key, 1) - 1
        if count:
            self._refs[key] = count
        else:
            self.live -= size

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight (or its transpose)
            return t
        key, size = self._key_and_size(t)
        return _Held(t, self, key, size)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextlib.contextmanager
    def active(self) -> Iterator[SavedTensorMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Held:
    """A saved tensor and its share of the meter's live count, given back when autograd drops it."""

    __slots__ = ("tensor", "meter", "key", "size")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: object, size: int):
        self.tensor, self.meter, self.key, self.size = tensor, meter, key, size
        meter._acquire(key, size)

    def __del__(self) -> None:
        self.meter._release(self.key, self.size)


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer, activations_peak: int) -> dict[str, int]:
    """This rank's bytes: its (local) parameters, one gradient per trainable one, the optimizer's state."""
    params = list(model.parameters())
    optimizer_bytes = sum(
        tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return {
        "parameters": sum(tensor_bytes(p) for p in params),
        "gradients": sum(tensor_bytes(p) for p in params if p.requires_grad),
        "optimizer": optimizer_bytes,
        "activations_peak": activations_peak,
    }


def resident_peak() -> int:
    """This process's peak resident memory so far, in bytes (Linux's VmHWM: what the OS measured, allocator
    caches, the Python interpreter and torch's libraries included); 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gather_memory(mine: dict[str, int], rank: int, world: int, device: torch.device,
                  fields: tuple[str, ...] = FIELDS) -> list[dict[str, int]]:
    """Every rank's ``fields`` of ``mine`` (default: `rank_memory`'s; a collective when there are several
    ranks), in rank order."""
    table = torch.zeros(world, len(fields), dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float(mine[f]) for f in fields], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(table)
    return [{"rank": r, **{f: int(v) for f, v in zip(fields, row, strict=True)}} for r, row in
            enumerate(table.cpu().tolist())]
