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


@torch.no_grad()
def init_(name: str, t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Initialize tensor ``name`` in place by its kind: Normal(0, ``std``) for a matrix (drawn from
    ``generator``, default torch's global one), ones for a norm's weight, zeros for the rest (router
    biases). The one rule of `Transformer.reset_parameters` and of `initial_value`."""
    if t.dim() >= 2:
        return t.normal_(0.0, std, generator=generator)
    if name.endswith("norm.weight") or "layernorm" in name:
        return t.fill_(1.0)
    return t.zero_()


def initial_value(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The fresh fp32 value of tensor ``name`` of ``shape`` in a run seeded with ``seed`` (`init_` from the
    tensor's own generator), on the CPU."""
    generator = torch.Generator().manual_seed(tensor_seed(seed, name)) if len(shape) >= 2 else None
    return init_(name, torch.empty(shape, dtype=torch.float32), std, generator)


def seeded_values(std: float, seed: int):
    """The fresh values of a run seeded with ``seed`` as a source for
    `dsv3.parallel.materialize.materialize`: (name, whole shape, rows of dim 0 or None) -> those values."""
    def values(name: str, shape: tuple[int, ...], rows: slice | None) -> torch.Tensor:
        value = initial_value(name, shape, std, seed)
        return value if rows is None else value[rows]

    return values
