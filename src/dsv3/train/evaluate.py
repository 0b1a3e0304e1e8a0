"""Held-out evaluation: next-token loss and bits per byte.

Bits per byte = total nats / ln 2 / total UTF-8 bytes of the predicted text, so it compares models
with different tokenizers. The end-of-document token stands for no bytes but its prediction is
charged (slightly pessimistic, and the same for any tokenizer that marks document ends).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dsv3.data.chat_sft import IGNORE_INDEX
from dsv3.data.packing import PackedSequences
from dsv3.train.distributed import World


def eval_windows(val: PackedSequences, eval_tokens: int) -> list[int]:
    """The first windows of the held-out stream covering about ``eval_tokens`` predicted tokens."""
    n = min(len(val), max(1, math.ceil(eval_tokens / val.seq_len)))
    return list(range(n))


@torch.no_grad()
def evaluate(
    parallel,
    val: PackedSequences,
    windows: list[int],
    token_bytes: np.ndarray,
    world: World,
    batch_size: int,
    autocast,
) -> dict[str, float]:
    """Loss (nats per token) and bits per byte over ``windows``, split across ranks and summed. ``parallel``:
    the model under its layout (`dsv3.parallel.parallelize.Parallelized`), which says which windows a rank
    takes and runs each batch's forward (through the pipeline stages under one: no rank holds the model)."""
    model = parallel.model
    was_training = model.training
    model.eval()
    mine, counted = parallel.eval_share(windows, world.rank)
    nats = torch.zeros((), dtype=torch.float64)
    n_bytes = n_tokens = 0
    for start in range(0, len(mine), batch_size):
        inputs, labels = val.batch(mine[start : start + batch_size])
        with autocast:
            nats += parallel.eval_nats(inputs, labels).cpu()
        labelled = labels[labels != IGNORE_INDEX].numpy()  # a chat's assistant tokens; every token of text
        n_bytes += int(token_bytes[labelled].sum())
        n_tokens += len(labelled)
    if not counted:  # another rank of this pipeline counts the same windows
        nats.zero_()
        n_bytes = n_tokens = 0
    totals = world.sum_(
        torch.tensor([nats.item(), n_bytes, n_tokens], dtype=torch.float64, device=world.device)
    )
    model.train(was_training)
    nats_total, bytes_total, tokens_total = totals.tolist()
    return {
        "val_loss": nats_total / max(tokens_total, 1.0),
        "val_bpb": nats_total / math.log(2) / max(bytes_total, 1.0),
        "val_tokens": int(tokens_total),
        "val_bytes": int(bytes_total),
    }
