"""What a server has loaded, kept out of Python's cyclic garbage collector while it serves.

A loaded model is about 300,000 Python objects (modules, parameters, the tokenizer, the libraries); a full
collection walks every one of them, about 100 ms on the ``small`` shape (``benchmarks/gc_pause.py``). When
one comes mid-decode it stalls every stream at once. ``gc.freeze`` moves the objects alive now into a
generation the collector never walks (a full collection then takes microseconds);
the objects made while serving are collected as before, and anything freed by its reference count is freed
as always. The heap is unfrozen on the way out, so that the interpreter's last collection sees it all
(otherwise the extension libraries report their objects as leaked at exit).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loaded_heap_frozen() -> Iterator[None]:
    """Collect once, freeze what is left for the duration of the block, unfreeze after it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
