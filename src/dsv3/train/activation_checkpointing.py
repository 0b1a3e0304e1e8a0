"""Activation checkpointing (``dsv3 train --ac``): keep fewer of the forward's activations for the backward
and recompute the others when the backward reaches them. Memory, not results: the recomputation runs the
same operations on the same inputs, so losses and gradients are bit for bit those of ``--ac none``.

* ``full``: each Transformer block (main and MTP) keeps only its inputs; its backward first re-runs its
  forward (under expert parallelism, the dispatch and combine all-to-alls too, on every rank alike).
* ``selective``: V3's choice, the cheap recomputations whose outputs are large: every RMSNorm, and MLA from
  its input to its output (the down- and up-projections with the attention they feed: torch's attention
  keeps its q, k and v for the backward, so the up-projections' outputs are only dropped when the
  attention is recomputed with them). The MoE layer's activations, and its all-to-alls, are kept.

A region is a module whose ``forward`` becomes a non-reentrant ``torch.utils.checkpoint``; module names,
state dicts and checkpoints do not change. Applied to the plain model, before ``parallelize``: pipeline
stages call the same modules, and FSDP's hooks gather the parameters around the block's forward and again
before its backward (where the recomputation runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv3.errors import DSV3Error
from dsv3.model.mla import MLA
from dsv3.model.moe import MoE
from dsv3.model.norm import RMSNorm
from dsv3.train.options import AC_MODES


def apply_activation_checkpointing(model: nn.Module, mode: str) -> list[nn.Module]:
    """Make ``model`` (a `Transformer`) recompute in its backward what ``mode`` says; returns the regions."""
    regions = checkpoint_regions(model, mode)
    for module in regions:
        recompute_in_backward(module)
    return regions


def checkpoint_regions(model: nn.Module, mode: str) -> list[nn.Module]:
    """The modules whose forward ``mode`` recomputes: none; every block; or every MLA and every RMSNorm
    outside one (an MLA's own norms are recomputed with it)."""
    if mode not in AC_MODES:
        raise DSV3Error(f"--ac must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "full":
        return list(model.model.layers)
    if mode == "selective":
        attention = [m for m in model.modules() if isinstance(m, MLA)]
        inside = {id(norm) for mla in attention for norm in mla.modules()}
        norms = [m for m in model.modules() if isinstance(m, RMSNorm) and id(m) not in inside]
        return attention + norms
    return []


def recompute_in_backward(module: nn.Module) -> None:
    """Replace ``module.forward`` by a checkpoint region around it. Without gradients (evaluation,
    sampling) it is the plain forward. The rng state is not saved and restored: the model draws no random
    numbers. Early stop is off, so that a recomputation always runs the whole region: under expert
    parallelism every rank then re-issues the same collectives."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = 0

        def region(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*args, **kwargs)
            with _bookkeeping_kept(module):
                return forward(*args, **kwargs)

        return checkpoint(region, *args, use_reentrant=False, preserve_rng_state=False, early_stop=False, **kwargs)

    module.forward = checkpointed


@contextlib.contextmanager
def _bookkeeping_kept(module: nn.Module) -> Iterator[None]:
    """A recomputation must not count its tokens again: the MoE layers' expert loads (which steer the router
    biases) and balance losses are put back as the forward left them."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    saved = [(m.expert_load.clone(), m.aux_loss) for m in layers]
    try:
        yield
    finally:
        for m, (load, aux) in zip(layers, saved, strict=True):
            m.expert_load.copy_(load)
            m.aux_loss = aux
