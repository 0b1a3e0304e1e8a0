"""The dtype a layer computes in: what ``nn.Linear`` would use for an input under the current autocast."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's own dtype. The fused autograd
    functions (routed experts, head loss) call it so that they follow autocast as ``nn.Linear`` does."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
