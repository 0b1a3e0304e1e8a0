"""Seeded initial values, one tensor at a time, each from its own name.

A model built on the ``meta`` device and spread over many processes (pipeline stages, expert shards, FSDP
shards) materializes only what each process holds. For a fresh run to have the very values one process
would have under any layout, a tensor's value cannot depend on the order in which a process draws its
tensors from one random stream: each tensor draws from a generator of its own, seeded by the run's seed and
the tensor's name in the whole model (a routed expert by its own name,
``model.layers.3.mlp.experts.5.gate_proj``, so an expert's value does not depend on which rank holds it).
"""

from __future__ import annotations

import hashlib

import torch


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for tensor ``name`` of a run seeded with ``seed`` (stable across processes and
    Python versions: a hash of the text, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def initial_value(name: str, shape: tuple[int, ...], std: float, seed: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fresh value of tensor ``name`` of ``shape``, as `Transformer.reset_parameters` initializes its kind:
    Normal(0, ``std``) for a matrix, ones for a norm's weight, zeros for the rest (router biases); on the CPU."""
    if len(shape) >= 2:
        generator = torch.Generator().manual_seed(tensor_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)
    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def seeded_values(std: float, seed: int):
    """The fresh values of a run seeded with ``seed`` as a source for
    `dsv3.parallel.materialize.materialize`: (name, whole shape, rows of dim 0 or None) -> those values."""
    def values(name: str, shape: tuple[int, ...], rows: slice | None) -> torch.Tensor:
        value = initial_value(name, shape, std, seed)
        return value if rows is None else value[rows]

    return values
