"""Per-request changes to the logits before sampling: ``logit_bias``, the repetition, frequency and
presence penalties, and ``min_tokens``, each as the API that defines it says.

Applied in this order to a row's logits (fp32) at each step, before temperature, top-k and top-p:

1. ``logit_bias`` (OpenAI): ``logit[t] += bias[t]`` for each listed token id.
2. ``repetition_penalty`` r (vLLM, after the CTRL paper and HF transformers): every token id seen in the
   prompt or in the generated text so far has ``logit / r`` when its logit is positive, ``logit * r``
   otherwise (r > 1 makes seen tokens less likely in both cases).
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): over the generated tokens only,
   ``logit[t] -= count[t] * f + (count[t] > 0) * p``.
4. ``min_tokens`` m (vLLM): while fewer than m tokens have been generated, end-of-sequence and the
   request's stop token ids get ``-inf`` (they cannot be drawn, greedy or not).

The reported ``logprobs`` are those of the changed logits (before temperature), so a client sees the
distribution its penalties produced. With MTP speculation the target row after a draft is changed as if
the draft were already generated: verification then accepts exactly the changed distribution.
"""

from __future__ import annotations

import torch

from dsv3.infer.sampling import SamplingParams


class LogitsRules:
    """The changes one request asks for, with what they need to remember: which ids the prompt holds,
    and how often each id has been generated. Built only when the request asks for at least one
    (``for_row``), so plain requests pay nothing."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], stop_ids: frozenset[int], vocab: int):
        self.params = params
        self.counts = torch.zeros(vocab, dtype=torch.float32)  # generated so far, per id
        self.generated = 0
        self.seen = torch.zeros(vocab, dtype=torch.bool)  # prompt or generated: what repetition_penalty reads
        self.seen[torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)] = True
        self.stop = torch.tensor(sorted(i for i in stop_ids if 0 <= i < vocab), dtype=torch.long)
        ids, values = zip(*params.logit_bias, strict=True) if params.logit_bias else ((), ())
        self.bias_ids = torch.tensor(ids, dtype=torch.long)
        self.bias_values = torch.tensor(values, dtype=torch.float32)

    @classmethod
    def for_row(cls, params: SamplingParams, prompt_ids: list[int], stop_ids: frozenset[int],
                vocab: int) -> LogitsRules | None:
        """The rules of a request, or None when it asks for none of them."""
        return cls(params, prompt_ids, stop_ids, vocab) if params.changes_logits else None

    def observe(self, token: int) -> None:
        """Count one generated token (call for each, in order)."""
        self.counts[token] += 1
        self.seen[token] = True
        self.generated += 1

    def apply(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """New fp32 logits [T, V] from logits [T, V]: row t as if ``drafts[:t]`` had been generated too (the
        rows a speculative step verifies after each draft)."""
        out = logits.float().clone()
        for t in range(out.shape[0]):
            extra = torch.tensor(list(drafts[:t]), dtype=torch.long)
            self._apply_row(out[t], extra)
        return out

    def _apply_row(self, row: torch.Tensor, extra: torch.Tensor) -> None:
        p = self.params
        if len(self.bias_ids):
            row.index_add_(0, self.bias_ids, self.bias_values)
        counts, seen = self.counts, self.seen
        if len(extra):
            counts = counts.index_add(0, extra, torch.ones(len(extra)))
            seen = seen.clone()
            seen[extra] = True
        if p.repetition_penalty != 1.0:
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty:
            row.sub_(counts * p.frequency_penalty)
        if p.presence_penalty:
            row.sub_((counts > 0).float() * p.presence_penalty)
        if self.generated + len(extra) < p.min_tokens and len(self.stop):
            row[self.stop] = float("-inf")
