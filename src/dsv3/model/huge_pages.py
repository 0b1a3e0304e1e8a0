"""CPU tensors on transparent huge pages, for what a decode step streams: the weights (the latent cache, which
a server allocates anew whenever its batch changes, stays on ordinary pages: see ``dsv3.model.mla.LatentCache``).

A batch-1 decode step reads every weight it touches once, about 100 MB on the ``small`` preset, so its
speed is the memory's read speed. With 4 KB pages that read also pays a TLB miss every 4 KB, and in a
virtual machine each miss is a two-level page walk; the hardware prefetchers stop at every page boundary
too. On this project's 2-core test machine (a VM) whole decode steps on 2 MB pages took 0.85-0.96x the
time in most cells (``benchmarks/decode_step_ab.py --baseline-rev`` a revision from before this module)
and ``x.sum()`` over 256 MB read 31-36% faster (1 thread).

Linux gives a mapping huge pages when it asks for them (``madvise(MADV_HUGEPAGE)``; the default
``transparent_hugepage`` mode on many distributions is ``madvise``) and is 2 MB aligned. PyTorch's CPU
allocator does neither unless ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation, and then only
for tensors of 2 MB or more, while a layer's projections are mostly smaller. So the tensors here live in
arenas: one anonymous mapping, aligned and advised, carved into one tensor per original (each its own
storage, so saving a state dict works as before). Without huge-page support (another OS, THP ``never``,
``DSV3_HUGE_PAGES=0``) the same functions return ordinary tensors: the values are the same either way.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """True when this process can ask for transparent huge pages."""
    if os.environ.get("DSV3_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Arena:
    """``nbytes`` of anonymous memory (zero-filled), 2 MB aligned and advised for huge pages, handed out
    as tensors by :meth:`take`. The mapping lives as long as any tensor taken from it."""

    def __init__(self, nbytes: int):
        self.size = _round_up(max(nbytes, 1), HUGE_PAGE)
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.base = (-address) % HUGE_PAGE  # the offset of the first 2 MB boundary in the mapping
        self._map.madvise(mmap.MADV_HUGEPAGE, self.base, self.size)
        self.used = 0

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of ``shape`` and ``dtype`` (contiguous, its own storage) from the arena."""
        nbytes = _nbytes(shape, dtype)
        if self.used + nbytes > self.size:
            raise ValueError(f"arena of {self.size} bytes cannot hold {nbytes} more after {self.used}")
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self.base + self.used)
        self.used += _round_up(nbytes, ALIGN)
        return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def zeros_many(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``torch.zeros(shape, dtype=dtype)`` for each shape, together on huge pages when the system gives
    them and they fill at least half a huge page (a smaller request would still take a whole 2 MB page)."""
    sizes = [_round_up(_nbytes(shape, dtype), ALIGN) for shape in shapes]
    if not available() or sum(sizes) < HUGE_PAGE // 2:
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    arena = Arena(sum(sizes))
    return [arena.take(shape, dtype) for shape in shapes]


def clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t``, on huge pages when :func:`zeros_many` puts it there."""
    return zeros_many([tuple(t.shape)], t.dtype)[0].copy_(t)


def _cpu_tensors(module: nn.Module):
    """(the dict that holds it, its name, the tensor) for every CPU parameter and buffer of ``module``, in
    module order (the order a forward pass meets them)."""
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is not None and t.device.type == "cpu" and t.numel():
                    yield store, name, t


def move_module(module: nn.Module) -> int:
    """Move ``module``'s CPU parameters and buffers onto huge pages, in place and in module order (so a
    forward pass reads one address range front to back), keeping their values, dtypes, shapes and
    ``Parameter`` objects. A tensor held twice (shared weights) stays shared; tensors this function
    already moved stay where they are (calling it again moves only what was replaced since). Returns
    the bytes moved (0 when huge pages are not available). Each old tensor is freed as soon as it is
    moved (unless something else holds it), so memory use peaks near the model plus its largest tensor,
    not twice the model."""
    if not available():
        return 0
    placed: frozenset[int] = getattr(module, "_huge_page_tensors", frozenset())
    sizes = {id(t): _round_up(t.nbytes, ALIGN) for _, _, t in _cpu_tensors(module)
             if t.data_ptr() not in placed}
    if not sizes:
        return 0
    arena = Arena(sum(sizes.values()))
    moved: dict[int, torch.Tensor] = {}
    for store, name, t in _cpu_tensors(module):
        key = id(t)
        if key not in sizes:
            continue
        if key not in moved:
            moved[key] = arena.take(t.shape, t.dtype).copy_(t.detach())
            if isinstance(t, nn.Parameter):
                t.data = moved[key]
                continue
        if not isinstance(t, nn.Parameter):
            store[name] = moved[key]
    module._huge_page_tensors = frozenset(t.data_ptr() for _, _, t in _cpu_tensors(module))
    return arena.used
