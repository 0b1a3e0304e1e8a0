"""The learning-rate schedule: linear warmup, then cosine decay to ``min_ratio`` of the peak.

V3 warms up linearly and decays with a cosine to a tenth of the peak (2.2e-4 -> 2.2e-5, V3 report
§4.2; docs/references.md); here the decay spans the rest of the configured steps, which suits short
runs.
"""

from __future__ import annotations

import math


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
