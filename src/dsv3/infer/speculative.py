"""Verification of drafted tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A draft d drawn from the draft distribution q is kept with probability min(1, p(d) / q(d)); on the
first rejection a token is drawn from the residual max(0, p - q) (renormalised) and the rest of the
drafts are dropped; when every draft is kept, one more token is drawn from p after the last draft.
Every emitted token is then distributed exactly as p, whatever q is; with one-hot (greedy) p and q the
rule reduces to "keep the draft iff it is the argmax", so greedy output equals plain greedy decoding.
"""

from __future__ import annotations

import torch

from dsv3.infer.sampling import draw, uniform


def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    """p: target distributions [k + 1, V] at the last token and after each draft; q: draft
    distributions [k, V]; drafts: k token ids. Returns (tokens to emit, number of drafts accepted)."""
    for i, d in enumerate(drafts):
        if uniform(gen) * float(q[i, d]) < float(p[i, d]):
            continue
        return drafts[:i] + [draw(residual(p[i], q[i]), gen)], i
    return drafts + [draw(p[len(drafts)], gen)], len(drafts)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what rejection sampling draws from after refusing a draft."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p
