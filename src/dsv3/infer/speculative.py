"""Verification of drafted tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A draft d drawn from the draft distribution q is kept with probability min(1, p(d) / q(d)); on the
first rejection a token is drawn from the residual max(0, p - q) (renormalised) and the rest of the
drafts are dropped; when every draft is kept, one more token is drawn from p after the last draft.
Every emitted token is then distributed exactly as p, whatever q is; with one-hot (greedy) p and q the
rule reduces to "keep the draft iff it is the argmax", so greedy output equals plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv3.infer.sampling import draw, uniform


def verify(p: torch.Tensor | Callable[[int], torch.Tensor], q: torch.Tensor, drafts: list[int],
           gen: torch.Generator) -> tuple[list[int], int]:
    """p: target distributions [k + 1, V] at the last token and after each draft, or a function giving
    row i [V] (so that rows after a rejection are never computed: with top-p each costs a sort of the
    vocabulary); q: draft distributions [k, V]; drafts: k token ids. Returns (tokens to emit, number of
    drafts accepted)."""
    row = p if callable(p) else p.__getitem__
    for i, d in enumerate(drafts):
        p_i = row(i)
        if uniform(gen) * float(q[i, d]) < float(p_i[d]):
            continue
        return drafts[:i] + [draw(residual(p_i, q[i]), gen)], i
    return drafts + [draw(row(len(drafts)), gen)], len(drafts)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what rejection sampling draws from after refusing a draft."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p
