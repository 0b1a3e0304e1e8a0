"""Parallelism over torch.distributed: layouts and ``parallelize``, the two-hop expert-parallel dispatcher,
EPLB placements."""

from dsv3.parallel.layout import Layout, Parallelized, parallelize

__all__ = ["Layout", "Parallelized", "parallelize"]
