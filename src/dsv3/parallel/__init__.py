"""Parallelism over torch.distributed: ``parallelize(model, layout)`` over one device mesh (pipeline
stages, the two-hop expert-parallel dispatcher, replicated / ZeRO-1 / FSDP data parallelism), EPLB
placements."""

from dsv3.layout import Layout
from dsv3.parallel.parallelize import Parallelized, parallelize

__all__ = ["Layout", "Parallelized", "parallelize"]
