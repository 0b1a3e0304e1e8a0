"""Per-request logits processors: the one place where a request changes its own next-token logits before
sampling (a grammar's mask, penalties, a logit bias).

A processor is a callable ``(tokens, logits) -> logits``:

- ``tokens``: the request's generated tokens that precede the position the logits predict (the prompt is
  not included). When MTP speculation verifies a draft, the row after the draft is processed with the draft
  appended, and the next call may then come with a shorter list (the draft was rejected): a stateful
  processor follows ``tokens``, not the order of its calls.
- ``logits``: fp32 [V], the engine's own copy for this request and position, which the processor may
  change in place; it returns the logits to sample from (the same tensor or a new one). A forbidden token
  gets ``-inf``; at least one token must stay finite.

The engine runs a request's processors, in order, on every row it samples from (the prefill's first token,
each decode step, both rows of a speculative verify) and on the MTP draft's logits, so a draft is drawn
from, and verified against, processed distributions. A request without processors costs nothing: the
engine never copies its logits. Log-probabilities (``logprobs``) stay those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def process(processors: Sequence[LogitsProcessor], tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [V] (fp32, owned by the caller) after each processor in turn."""
    for processor in processors:
        logits = processor(tokens, logits)
    return logits
